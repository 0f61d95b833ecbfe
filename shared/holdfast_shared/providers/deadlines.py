"""The time a model call may take: every provider's stream, bounded the same way.

The SDKs' own timeouts watch bytes, not answers: a server that sends
keep-alives (Anthropic's ``ping``) but no token, or tokens forever without a
stop, would hold a turn until its deadline. :func:`bounded` watches the
normalized events instead: the first must come within ``first_event``
seconds, each next one within ``idle``, and the call ends within ``call``.
A missed first event or gap is a retryable :class:`ProviderError` (the
connection most likely hung; the call is made again); a call past ``call``
is not (a stream that never stops would do it again). Configured in one
place, :class:`~holdfast_shared.settings.Settings` (``HOLDFAST_MODEL_*_TIMEOUT_SECONDS``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from holdfast_shared.errors import ErrorCode
from holdfast_shared.providers.base import ModelEvent, ProviderError
from holdfast_shared.settings import Settings, get_settings


@dataclass(frozen=True, slots=True)
class CallLimits:
    first_event: float
    idle: float
    call: float

    @classmethod
    def of(cls, settings: Settings) -> CallLimits:
        return cls(
            settings.model_first_event_timeout_seconds,
            settings.model_idle_timeout_seconds,
            settings.model_call_timeout_seconds,
        )


def configured_limits() -> CallLimits:
    return CallLimits.of(get_settings())


async def bounded(
    stream: AsyncIterator[ModelEvent], limits: CallLimits
) -> AsyncIterator[ModelEvent]:
    """``stream``'s events, each within its time; the stream closed when one is late."""
    loop = asyncio.get_running_loop()
    ends = loop.time() + limits.call
    wait, waiting_for = limits.first_event, "first event"
    try:
        while True:
            left = ends - loop.time()
            budget = min(wait, left)
            try:
                # Only the wait for the provider is timed: never the consumer's
                # work between two events (a yield inside the scope would be).
                async with asyncio.timeout(budget) as scope:
                    event = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                if not scope.expired():
                    raise
                raise _late(waiting_for, wait, limits.call, whole=budget >= left) from exc
            wait, waiting_for = limits.idle, "next event"
            yield event
    finally:
        if isinstance(stream, AsyncGenerator):
            await stream.aclose()


def _late(waiting_for: str, wait: float, call: float, *, whole: bool) -> ProviderError:
    if whole:
        return ProviderError(
            ErrorCode.LLM_PROVIDER_ERROR,
            f"the model call went on past its {call:g} s "
            "(HOLDFAST_MODEL_CALL_TIMEOUT_SECONDS) without finishing",
            details={"timeout": "call", "seconds": call},
        )
    return ProviderError(
        ErrorCode.LLM_PROVIDER_ERROR,
        f"the model sent no {waiting_for} within {wait:g} s",
        details={"timeout": waiting_for.replace(" ", "_"), "seconds": wait},
        retryable=True,
    )
