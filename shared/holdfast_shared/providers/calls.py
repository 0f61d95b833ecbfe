"""A model call, the same for every provider: bounded in time, retried, and
observed when asked.

Time (:func:`bounded`). The SDKs' own timeouts watch bytes, not answers: a
server that sends keep-alives (Anthropic's ``ping``) but no token, or tokens
forever without a stop, would hold a turn until its deadline. :func:`bounded`
watches the normalized events instead: the first must come within
``first_event`` seconds, each next one within ``idle``, and the call ends
within ``call``. A missed first event or gap is a retryable
:class:`ProviderError` (the connection most likely hung; the call is made
again); a call past ``call`` is not (a stream that never stops would do it
again). Configured in one place, :class:`~holdfast_shared.settings.Settings`
(``HOLDFAST_MODEL_*_TIMEOUT_SECONDS``).

Retries (tenacity): a call that failed before it produced anything is simply
made again. Once output reached the client, repeating the call would show
the user text twice: a caller that can take that output back passes
``on_restart``, which is awaited before the next attempt (the loop-worker
marks the attempt's events discarded, ``turn/model_step.py``); without it,
or on the last attempt, the failure is final (:class:`StreamInterrupted`)
and the loop ends the turn cleanly. Waits back off exponentially with jitter and never
undercut the server's ``retry-after`` (capped at ``max_wait``).

``before_attempt`` is awaited before every attempt, the first included: the
learning centre gives way there to the turns calling the same local server,
whose next request would otherwise cut its retry off (or be cut off by it).

Observation (``observe=True``, the turn's own calls; :func:`observed_model_call`):
a span, time to first token, tokens and duration per call, retries included.
The span follows the OpenTelemetry GenAI semantic conventions: named
``chat {model}``, kind CLIENT, with ``gen_ai.operation.name``,
``gen_ai.system`` (and its successor ``gen_ai.provider.name``),
``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` /
``output_tokens`` and ``gen_ai.response.finish_reasons``. Prompts and
completions are not recorded: they are the tenants' data. Sub-calls (a
compaction's summary, a skill's, an MCP server's sampling, the learning
centre's extraction) are not observed, so the model metrics count the turns'
answers alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from opentelemetry.trace import SpanKind
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from holdfast_shared.errors import ErrorCode
from holdfast_shared.observability import metrics, tracing
from holdfast_shared.providers.base import (
    Finish,
    ModelEvent,
    ModelRequest,
    Provider,
    ProviderError,
    UsageReport,
)
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


class StreamInterrupted(ProviderError):
    """The stream failed after output was already emitted; not retried."""

    def __init__(self, cause: ProviderError) -> None:
        super().__init__(
            cause.code,
            f"the model stream broke off after partial output: {cause.message}",
            details={**(cause.details or {}), "partial_output": True},
            status=cause.status,
        )


def _retryable(exc: BaseException) -> bool:
    return (
        isinstance(exc, ProviderError) and not isinstance(exc, StreamInterrupted) and exc.retryable
    )


class _WaitHonouringRetryAfter:
    def __init__(self, initial: float, maximum: float) -> None:
        self._backoff = wait_exponential_jitter(initial=initial, max=maximum)
        self._maximum = maximum

    def __call__(self, state: RetryCallState) -> float:
        wait = float(self._backoff(state))
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, ProviderError) and exc.retry_after is not None:
            wait = max(wait, min(exc.retry_after, self._maximum))
        return wait


# Takes back an attempt's output before the call is made again.
Restart = Callable[[ProviderError], Awaitable[None]]


def stream_with_retries(
    provider: Provider,
    request: ModelRequest,
    *,
    attempts: int = 4,
    initial_wait: float = 0.5,
    max_wait: float = 30.0,
    on_restart: Restart | None = None,
    limits: CallLimits | None = None,
    before_attempt: Callable[[], Awaitable[None]] | None = None,
    observe: bool = False,
) -> AsyncIterator[ModelEvent]:
    """``provider.stream(request)``, each attempt within ``limits`` (else the
    configured ones, :func:`configured_limits`), retried on retryable failures: before
    any output, or after it when ``on_restart`` took that output back.
    ``observe`` makes it one observed call of ``provider.name:request.model``
    (:func:`observed_model_call`), its retries included."""
    stream = _retried(
        provider,
        request,
        attempts=attempts,
        initial_wait=initial_wait,
        max_wait=max_wait,
        on_restart=on_restart,
        limits=limits,
        before_attempt=before_attempt,
    )
    if not observe:
        return stream
    return observed_model_call(provider.name, request.model, stream)


async def _retried(
    provider: Provider,
    request: ModelRequest,
    *,
    attempts: int,
    initial_wait: float,
    max_wait: float,
    on_restart: Restart | None,
    limits: CallLimits | None,
    before_attempt: Callable[[], Awaitable[None]] | None,
) -> AsyncIterator[ModelEvent]:
    limits = limits or configured_limits()
    retrying = AsyncRetrying(
        retry=retry_if_exception(_retryable),
        wait=_WaitHonouringRetryAfter(initial_wait, max_wait),
        stop=stop_after_attempt(attempts),
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            produced = False
            if before_attempt is not None:
                await before_attempt()
            try:
                async for event in bounded(provider.stream(request), limits):
                    produced = True
                    yield event
            except ProviderError as exc:
                if not produced:
                    raise
                last = attempt.retry_state.attempt_number >= attempts
                if on_restart is None or last or not _retryable(exc):
                    raise StreamInterrupted(exc) from exc
                await on_restart(exc)
                raise


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
