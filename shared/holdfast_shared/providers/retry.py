"""Retries around a model stream (tenacity), the same for every provider.

A call that failed before it produced anything is simply made again. Once
output reached the client, repeating the call would show the user text
twice: a caller that can take that output back passes ``on_restart``, which
is awaited before the next attempt (the loop-worker marks the attempt's
events discarded, ``turn/model_step.py``); without it, or on the last
attempt, the failure is final (:class:`StreamInterrupted`) and the loop ends
the turn cleanly. Waits back off exponentially with jitter and never
undercut the server's ``retry-after`` (capped at ``max_wait``).

``before_attempt`` is awaited before every attempt, the first included: the
learning centre gives way there to the turns calling the same local server,
whose next request would otherwise cut its retry off (or be cut off by it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from holdfast_shared.providers.base import (
    ModelEvent,
    ModelRequest,
    Provider,
    ProviderError,
)
from holdfast_shared.providers.deadlines import CallLimits, bounded, configured_limits


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


async def stream_with_retries(
    provider: Provider,
    request: ModelRequest,
    *,
    attempts: int = 4,
    initial_wait: float = 0.5,
    max_wait: float = 30.0,
    on_restart: Restart | None = None,
    limits: CallLimits | None = None,
    before_attempt: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[ModelEvent]:
    """``provider.stream(request)``, each attempt within ``limits`` (else the
    configured ones, ``deadlines.py``), retried on retryable failures: before
    any output, or after it when ``on_restart`` took that output back."""
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
