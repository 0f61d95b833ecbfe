"""What a stream does, without doing any I/O: the part both clients share.

:class:`Resumer` decides which request to send (``POST /execute`` first,
``GET /execute/replay`` with ``Last-Event-ID`` after a drop), which received
events to hand to the caller (each seq once, in order, of the caller's turn
only), when the stream is finished (the turn's terminal ``thread_lifecycle``)
and how long to wait before reconnecting (the server's ``retry:`` field,
doubled on each consecutive failure). :mod:`holdfast_client.client` drives it
with blocking or asyncio I/O.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import httpx

from holdfast_client.errors import BAD_RESPONSE, CONNECTION_LOST, HoldfastError
from holdfast_client.events import Event, ThreadLifecycle, UserMessage, parse_event

# A replay or reconnect answered with one of these is worth trying again.
_RETRYABLE_STATUSES = frozenset({429, 502, 503, 504})
# A 429 on POST /execute is the tenant's limit on turns: the caller's to wait on.
_RETRYABLE_POST_STATUSES = frozenset({502, 503, 504})


class FrameLike(Protocol):
    """An SSE frame: ``holdfast_client._sse.Frame`` or httpx-sse's ``ServerSentEvent``."""

    @property
    def event(self) -> str: ...
    @property
    def data(self) -> str: ...
    @property
    def retry(self) -> int | None: ...


@dataclass(frozen=True)
class Reconnect:
    """How a stream reconnects after its connection dropped.

    ``delay`` is the first wait when the server named none in a ``retry:``
    field (the server's wins); every further consecutive failure doubles
    the wait, up to ``max_delay``. After ``max_attempts`` failures in a row
    with nothing received in between, the stream raises
    :class:`HoldfastError` ``CONNECTION_LOST``.
    """

    delay: float = 0.5
    max_delay: float = 15.0
    max_attempts: int = 12


DEFAULT_RECONNECT = Reconnect()


@dataclass(frozen=True)
class Attempt:
    """One HTTP request of a stream."""

    method: str
    path: str
    params: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    json: dict[str, Any] | None = None


class Resumer:
    """The state of one stream across its connections.

    With ``body`` it starts a turn (``POST /execute``) and ends at that
    turn's terminal ``thread_lifecycle``; with ``turn_id`` it follows that
    turn of ``task_id`` (from its start) to the same end; with neither, it
    replays ``task_id``'s events after ``after_seq`` and ends when the
    server ends the replay (after the stored events, or at the end of the
    turn running then).
    """

    def __init__(
        self,
        *,
        body: dict[str, Any] | None = None,
        task_id: str | None = None,
        turn_id: str | None = None,
        after_seq: int = 0,
        after_timestamp: int | None = None,
        reconnect: Reconnect = DEFAULT_RECONNECT,
        idempotency_key: str | None = None,
    ) -> None:
        self.task_id = task_id
        # Sent with the POST (and with the POST sent again): the engine runs the
        # message once however often it arrives (README, Sending a message again).
        self.idempotency_key = idempotency_key or str(uuid.uuid4())
        self.turn_id = turn_id
        # The seq of the last event handed to the caller: the resume cursor.
        self.last_seq = after_seq
        self.done = False
        self._body = body
        self._after_timestamp = after_timestamp
        self._policy = reconnect
        self._posted = body is None
        self._follows_turn = body is not None or turn_id is not None
        self._first_connection = False
        # Until the turn's own started event is seen after a reconnect that
        # had no cursor yet, older turns' events are skipped.
        self._started = False
        self._server_retry: float | None = None
        self._retry_after: float | None = None
        self._failures = 0

    @property
    def follows_turn(self) -> bool:
        """True when the stream ends at one turn's end (not at the server's)."""
        return self._follows_turn

    def request(self) -> Attempt:
        """The next request to send."""
        if self._body is not None and not self._posted:
            key = {"Idempotency-Key": self.idempotency_key}
            return Attempt("POST", "/execute", headers=key, json=self._body)
        assert self.task_id is not None  # a POST that answered named it (X-Task-Id)
        params = {"task_id": self.task_id}
        headers: dict[str, str] = {}
        if self.last_seq > 0:
            headers["Last-Event-ID"] = str(self.last_seq)
        elif self._after_timestamp is not None:
            params["after"] = str(self._after_timestamp)
        return Attempt("GET", "/execute/replay", params=params, headers=headers)

    def opened(self, response: httpx.Response) -> None:
        """A 2xx answer's headers arrived."""
        kind = response.headers.get("Content-Type", "")
        if not kind.startswith("text/event-stream"):
            # Something between us and the engine answered (a captive portal,
            # a misrouted proxy): not a stream to read, nor to retry blindly.
            raise HoldfastError(
                response.status_code,
                BAD_RESPONSE,
                f"expected an event stream, got {kind or 'no Content-Type'} from {response.url}",
            )
        self._retry_after = None
        self._first_connection = self._body is not None and not self._posted
        if self._first_connection:
            self._posted = True
            self.task_id = response.headers.get("X-Task-Id") or self.task_id
            self.turn_id = response.headers.get("X-Turn-Id")

    def refused(self, response: httpx.Response, body: bytes) -> float:
        """A non-2xx answer: the wait before trying again, or its error raised.

        A ``POST /execute`` is sent again on a 502/503/504 (its
        Idempotency-Key makes that safe); any other refusal started nothing
        and is the caller's to decide on (a 409 ``TURN_IN_PROGRESS``, a 429
        for the tenant's turns).
        """
        error = HoldfastError.from_response(response, body)
        posting = self._body is not None and not self._posted
        retryable = _RETRYABLE_POST_STATUSES if posting else _RETRYABLE_STATUSES
        if response.status_code not in retryable:
            raise error
        self._retry_after = error.retry_after
        return self._next_wait(error)

    def feed(self, sse: FrameLike) -> Event | None:
        """The event to hand to the caller for this frame, if any."""
        if sse.retry is not None:
            self._server_retry = sse.retry / 1000
        data, kind = sse.data, sse.event
        if not data:
            return None
        if kind == "heartbeat":
            self._failures = 0  # the connection is alive, with nothing to say
            return None
        event = parse_event(data, kind)
        seq = event.seq
        if seq <= self.last_seq:
            # Delivered before the connection dropped (or a heartbeat that
            # came without its event name: they have no seq).
            return None
        if not self._started and self._follows_turn:
            if not self._is_ours(event):
                self.last_seq = seq  # an earlier turn's: skipped, not re-read
                return None
            self._started = True
            self.turn_id = event.turn_id
        self.last_seq = seq
        self._failures = 0
        if (
            event.type == "thread_lifecycle"
            and self._follows_turn
            and cast(ThreadLifecycle, event).ends_turn
            and event.turn_id == self.turn_id
        ):
            self.done = True
        return event

    def _is_ours(self, event: Event) -> bool:
        """Whether the first event of the stream's turn is this one.

        On the ``POST``'s own connection the server sends only what belongs
        to the request: its first event is. After a reconnect that had no
        cursor yet, it is the event of the turn the ``POST`` named in
        ``X-Turn-Id``, or — for a steered message, whose ``X-Turn-Id`` is
        the message's id — the ``user_message`` carrying that id.
        """
        if self._first_connection or self.turn_id is None:
            return True
        if isinstance(event, UserMessage) and event.message_id == self.turn_id:
            return True
        return event.turn_id == self.turn_id

    def ended(self) -> float | None:
        """The server closed the stream cleanly: None when that finishes it,
        else the wait before reconnecting (a turn's stream ends at its end)."""
        if not self.follows_turn:
            self.done = True
            return None
        return self._next_wait(None)

    def lost(self, exc: Exception) -> float:
        """The connection failed: the wait before reconnecting, or raise.

        A ``POST /execute`` that dropped before its answer may have started
        the turn: it is sent again with the same Idempotency-Key, and the
        engine streams that turn instead of starting another.
        """
        return self._next_wait(exc)

    def _next_wait(self, cause: Exception | None) -> float:
        self._failures += 1
        if self._failures > self._policy.max_attempts:
            raise HoldfastError(
                None,
                CONNECTION_LOST,
                f"gave up after {self._policy.max_attempts} reconnects in a row "
                f"(last seq delivered: {self.last_seq}; last failure: {cause!r})",
                {"task_id": self.task_id, "last_seq": self.last_seq},
            ) from cause
        base = self._server_retry if self._server_retry is not None else self._policy.delay
        wait = min(self._policy.max_delay, base * 2.0 ** (self._failures - 1))
        if self._retry_after is not None:
            wait = max(wait, self._retry_after)
        return wait
