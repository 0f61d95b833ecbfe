"""Retries around a model stream (tenacity), the same for every provider.

A call is retried only while it has produced nothing: once a delta reached
the client, repeating the call would show the user text twice, so a failure
after that point is final (:class:`StreamInterrupted`) and the loop ends the
turn cleanly (see the loop-worker's ``turn/model_step.py``). Waits back off
exponentially with jitter and never undercut the server's ``retry-after``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

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


async def stream_with_retries(
    provider: Provider,
    request: ModelRequest,
    *,
    attempts: int = 4,
    initial_wait: float = 0.5,
    max_wait: float = 30.0,
) -> AsyncIterator[ModelEvent]:
    """``provider.stream(request)``, retried on retryable failures before any output."""
    retrying = AsyncRetrying(
        retry=retry_if_exception(_retryable),
        wait=_WaitHonouringRetryAfter(initial_wait, max_wait),
        stop=stop_after_attempt(attempts),
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            produced = False
            try:
                async for event in provider.stream(request):
                    produced = True
                    yield event
            except ProviderError as exc:
                if produced:
                    raise StreamInterrupted(exc) from exc
                raise
