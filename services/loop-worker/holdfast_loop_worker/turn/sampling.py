"""An MCP server's ``sampling/createMessage`` during a tool call, served by the
turn's own model (the runner relays it: tool-runner ``connectors/sampling.py``).

The call goes through the engine's providers under the model the turn runs
with (the agent's), with the turn's retries, inside the call's remaining time;
its tokens are added to the turn's ``usage``, as a skill's sub-call's are.
Nothing of it is streamed to the client or stored as a message: the server
gets the text, and what it makes of it is the tool's result.
"""

from __future__ import annotations

import asyncio

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.events import USAGE_COUNTS
from holdfast_shared.jobs import SamplingAnswer, ToolSampling
from holdfast_shared.providers import ModelChoice, ProviderError, TextChunk, UsageReport
from holdfast_shared.providers.base import Finish, ModelRequest
from holdfast_shared.providers.calls import stream_with_retries

# A server may ask for more; a sub-call is not the turn's answer.
MAX_TOKENS = 4096


def _request(choice: ModelChoice, asked: ToolSampling) -> ModelRequest:
    messages = tuple(
        ChatMessage(
            "assistant" if message.get("role") == "assistant" else "user",
            ({"type": "text", "text": message.get("text", "")},),
        )
        for message in asked.messages
    )
    return ModelRequest(
        model=choice.model,
        system=asked.system_prompt or "",
        messages=messages,
        max_tokens=max(1, min(asked.max_tokens, MAX_TOKENS)),
    )


async def sample(
    choice: ModelChoice, asked: ToolSampling, *, attempts: int, usage: dict[str, int]
) -> SamplingAnswer:
    """The model's answer to ``asked`` (or why there is none); ``usage`` gets its tokens."""
    text: list[str] = []
    stop: str | None = None
    try:
        async with asyncio.timeout(asked.wait_seconds):
            stream = stream_with_retries(
                choice.provider, _request(choice, asked), attempts=attempts
            )
            async for event in stream:
                if isinstance(event, TextChunk):
                    text.append(event.text)
                elif isinstance(event, UsageReport):
                    for name in USAGE_COUNTS:
                        usage[name] = usage.get(name, 0) + getattr(event, name)
                elif isinstance(event, Finish):
                    stop = event.stop_reason
    except ProviderError as exc:
        return SamplingAnswer(error=f"the model call failed: {exc.message}")
    except TimeoutError:
        return SamplingAnswer(error="the model did not answer within the tool call's time")
    return SamplingAnswer(
        text="".join(text),
        model=f"{choice.provider.name}:{choice.model}",
        stop_reason=_MCP_STOP.get(stop or "", stop),
    )


# The providers' stop reasons (Anthropic's words) in MCP's.
_MCP_STOP = {"end_turn": "endTurn", "max_tokens": "maxTokens", "stop_sequence": "stopSequence"}
