"""A model call observed: its GenAI span, time to first token, tokens and duration.

The span follows the OpenTelemetry GenAI semantic conventions: named
``chat {model}``, kind CLIENT, with ``gen_ai.operation.name``,
``gen_ai.system`` (and its successor ``gen_ai.provider.name``),
``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` /
``output_tokens`` and ``gen_ai.response.finish_reasons``. Prompts and
completions are not recorded: they are the tenants' data.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from holdfast_shared.observability import metrics, tracing
from holdfast_shared.providers.base import Finish, ModelEvent, UsageReport
from opentelemetry.trace import SpanKind


async def observed_model_call(
    system: str, model: str, stream: AsyncIterator[ModelEvent]
) -> AsyncIterator[ModelEvent]:
    """``stream`` (one call to ``system:model``, retries included), passed through."""
    label = metrics.model_label(f"{system}:{model}")
    # Not current: this generator's code runs in its consumer's context a piece
    # at a time, so a context attached here could not be detached in order.
    span = tracing.start_span(
        f"chat {model}",
        kind=SpanKind.CLIENT,
        attributes={
            "gen_ai.operation.name": "chat",
            "gen_ai.system": system,
            "gen_ai.provider.name": system,
            "gen_ai.request.model": model,
        },
    )
    started = time.perf_counter()
    first_output = False
    usage = {"input": 0, "output": 0, "cache_read": 0, "cache_creation": 0, "reasoning": 0}
    finish_reasons: list[str] = []
    error: BaseException | None = None
    try:
        async for item in stream:
            if isinstance(item, UsageReport):
                usage["input"] += item.input_tokens
                usage["output"] += item.output_tokens
                usage["cache_read"] += item.cache_read_input_tokens
                usage["cache_creation"] += item.cache_creation_input_tokens
                usage["reasoning"] += item.reasoning_tokens
            elif isinstance(item, Finish):
                finish_reasons.append(item.stop_reason)
            elif not first_output:
                first_output = True
                metrics.MODEL_TIME_TO_FIRST_TOKEN.labels(label).observe(
                    time.perf_counter() - started
                )
            yield item
    except (asyncio.CancelledError, GeneratorExit):
        raise  # stopped from outside: not the model's failure
    except BaseException as exc:
        error = exc
        raise
    finally:
        metrics.MODEL_CALL_SECONDS.labels(label, "error" if error else "ok").observe(
            time.perf_counter() - started
        )
        for kind, count in usage.items():
            if count:
                metrics.MODEL_TOKENS.labels(label, kind).inc(count)
        if span is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage["input"])
            span.set_attribute("gen_ai.usage.output_tokens", usage["output"])
            if finish_reasons:
                span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
        tracing.end_span(span, error=error)
