"""``Client`` (blocking) and ``AsyncClient`` (asyncio): the same API, the same logic.

What a stream does is decided by :class:`holdfast_client._resume.Resumer`
and what each operation sends and reads by :mod:`holdfast_client._api`
(whose functions both clients take as their methods, through :class:`_Operation`);
the two classes only carry out the I/O, each in its own style.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Generator,
    Iterator,
    Mapping,
)
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Literal, ParamSpec, Self, TypeVar, overload

import httpx

from holdfast_client import _api
from holdfast_client._api import Call
from holdfast_client._resume import DEFAULT_RECONNECT, Attempt, Reconnect, Resumer
from holdfast_client._sse import FrameDecoder
from holdfast_client.errors import HoldfastError
from holdfast_client.events import Event
from holdfast_client.text import TurnText

T = TypeVar("T")
P = ParamSpec("P")
# The stream a client opens: TurnStream, or AsyncTurnStream.
S = TypeVar("S")
# A stream's client, and the generator of its events.
C = TypeVar("C")
E = TypeVar("E")
# What sends its requests: httpx.Client, or httpx.AsyncClient.
H = TypeVar("H", httpx.Client, httpx.AsyncClient)

DEFAULT_URL = "http://127.0.0.1:8000"
# Long enough for several of the server's heartbeats (15 s by default): a
# stream silent for longer than this is dead and is reconnected.
DEFAULT_STREAM_READ_TIMEOUT = 60.0


def default_key() -> str | None:
    """``HOLDFAST_API_KEY``, else the key ``holdfast up`` saved in its data directory."""
    key = os.environ.get("HOLDFAST_API_KEY")
    if key:
        return key.strip()
    data_dir = Path(os.environ.get("HOLDFAST_DATA_DIR") or Path.home() / ".holdfast")
    try:
        return (data_dir / "api-key").read_text().strip() or None
    except OSError:
        return None


def _settings(
    url: str | None, key: str | None, timeout: float, read_timeout: float
) -> dict[str, Any]:
    key = key or default_key()
    if not key:
        raise HoldfastError(
            None,
            "NO_API_KEY",
            "no API key: pass key=, set HOLDFAST_API_KEY or run `holdfast up` once",
        )
    return {
        "base_url": (url or os.environ.get("HOLDFAST_URL") or DEFAULT_URL).rstrip("/"),
        "headers": {"X-Engine-Key": key},
        "timeout": httpx.Timeout(timeout, read=max(timeout, read_timeout)),
    }


def _request_args(attempt: Attempt | Call[Any]) -> dict[str, Any]:
    args: dict[str, Any] = {"params": attempt.params or None, "headers": attempt.headers or None}
    if attempt.json is not None:
        args["json"] = attempt.json
    if isinstance(attempt, Call) and attempt.content is not None:
        args["content"] = attempt.content
    return args


OnBusy = Literal["reject", "enqueue", "interrupt", "steer"]
_STREAM_OPTIONS = (
    "task_id",
    "agent",
    "on_busy",
    "user_id",
    "model",
    "media",
    "edit_message_id",
    "retry_message_id",
    "output_schema",
    "webhook",
)


def _options(arguments: dict[str, Any]) -> dict[str, Any]:
    """The ``POST /execute`` fields among a ``stream`` call's arguments."""
    return {name: arguments[name] for name in _STREAM_OPTIONS}


@contextmanager
def _connection_errors() -> Iterator[None]:
    try:
        yield
    except httpx.TransportError as exc:
        raise HoldfastError(None, "CONNECTION_FAILED", repr(exc)) from exc


def _answer(call: Call[T], response: httpx.Response) -> T:
    if response.status_code >= 400:
        raise HoldfastError.from_response(response, response.content)
    return call.read(response)


class _Stream(Generic[C, E]):
    """What both streams hold: the turn's cursor and text, and how a chunk becomes
    events; ``C`` is the client, ``E`` the generator of events ``_run`` returns."""

    def __init__(self, client: C, resumer: Resumer) -> None:
        self._client = client
        self._resumer = resumer
        self.transcript = TurnText()
        self._events: E = self._run()

    def _run(self) -> E:
        raise NotImplementedError

    @property
    def task_id(self) -> str | None:
        return self._resumer.task_id

    @property
    def turn_id(self) -> str | None:
        return self._resumer.turn_id

    @property
    def last_seq(self) -> int:
        return self._resumer.last_seq

    def _decoded(self, frames: FrameDecoder, chunk: bytes) -> Iterator[Event]:
        # Lazily, one event at a time: ``last_seq`` is the last event yielded,
        # and nothing after the turn's end is read.
        for sse in frames.feed(chunk):
            event = self._resumer.feed(sse)
            if event is not None:
                self.transcript.feed(event)
                yield event
                if self._resumer.done:
                    return


class TurnStream(_Stream["Client", Generator[Event, None, None]]):
    """The events of one turn (or replay), each once and in order; iterate it once.

    ``task_id`` and ``turn_id`` are known as soon as the engine answered,
    ``last_seq`` is the seq of the last event yielded (the cursor to replay
    after), ``transcript`` the turn's text so far with discarded deltas
    taken out. Heartbeats are not yielded.
    """

    def __iter__(self) -> Iterator[Event]:
        return self._events

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading (the turn itself goes on; :meth:`Client.cancel` stops it)."""
        self._events.close()

    def until_done(self) -> TurnText:
        """Read the stream to its end; the turn's text."""
        for _ in self:
            pass
        return self.transcript

    def _run(self) -> Generator[Event, None, None]:
        r, http = self._resumer, self._client.http
        while True:
            attempt = r.request()
            wait: float | None
            try:
                with http.stream(attempt.method, attempt.path, **_request_args(attempt)) as resp:
                    if resp.status_code >= 300:
                        wait = r.refused(resp, resp.read())
                    else:
                        r.opened(resp)
                        frames = FrameDecoder()
                        for chunk in resp.iter_bytes():
                            yield from self._decoded(frames, chunk)
                            if r.done:
                                return
                        wait = r.ended()
            except httpx.TransportError as exc:
                wait = r.lost(exc)
            if wait is None:
                return  # the stream ended as it should
            time.sleep(wait)


class AsyncTurnStream(_Stream["AsyncClient", AsyncGenerator[Event, None]]):
    """:class:`TurnStream` for :class:`AsyncClient`: iterate it with ``async for``."""

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._events.aclose()

    async def until_done(self) -> TurnText:
        async for _ in self:
            pass
        return self.transcript

    async def _run(self) -> AsyncGenerator[Event, None]:
        r, http = self._resumer, self._client.http
        while True:
            attempt = r.request()
            wait: float | None
            try:
                async with http.stream(
                    attempt.method, attempt.path, **_request_args(attempt)
                ) as resp:
                    if resp.status_code >= 300:
                        wait = r.refused(resp, await resp.aread())
                    else:
                        r.opened(resp)
                        frames = FrameDecoder()
                        async for chunk in resp.aiter_bytes():
                            for event in self._decoded(frames, chunk):
                                yield event
                            if r.done:
                                return
                        wait = r.ended()
            except httpx.TransportError as exc:
                wait = r.lost(exc)
            if wait is None:
                return
            await asyncio.sleep(wait)


class _Operation(Generic[P, T]):
    """One non-streaming operation, declared once for both clients.

    ``client.name(...)`` sends the request ``build(...)`` describes and returns
    its answer (awaited, on :class:`AsyncClient`); the method has ``build``'s
    signature and docstring.
    """

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self._build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, client: Client, owner: type[Any]) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, client: AsyncClient, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, client: Client | AsyncClient | None, owner: type[Any]) -> Any:
        if client is None:
            return self
        return client._sender(self._build)


class _Base(Generic[S, H]):
    """Everything but the I/O, for both clients: streams are opened as ``S``
    and requests sent by ``H``."""

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        stream_read_timeout: float = DEFAULT_STREAM_READ_TIMEOUT,
        reconnect: Reconnect = DEFAULT_RECONNECT,
        http: H | None = None,
    ) -> None:
        self.reconnect = reconnect
        self.http: H = http or self._connect(_settings(url, key, timeout, stream_read_timeout))

    def _connect(self, settings: dict[str, Any]) -> H:
        raise NotImplementedError

    def _open(self, resumer: Resumer) -> S:
        raise NotImplementedError

    # -- turns --------------------------------------------------------------------------

    def stream(
        self,
        message: str | None,
        *,
        task_id: str | None = None,
        agent: str | None = None,
        on_busy: OnBusy | None = None,
        user_id: str | None = None,
        model: str | None = None,
        media: list[Mapping[str, Any]] | None = None,
        edit_message_id: int | None = None,
        retry_message_id: int | None = None,
        output_schema: Mapping[str, Any] | None = None,
        webhook: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> S:
        """Send ``message`` (to ``task_id``, or a new task) and stream the turn.

        The request is sent when iteration starts. A dropped connection is
        resumed from the last event yielded, so every event comes once, in
        order, up to the turn's terminal ``thread_lifecycle``. ``on_busy``
        says what a message for a task with a running turn does (``reject``,
        ``enqueue``, ``interrupt``, ``steer``: see the engine's README);
        ``edit_message_id`` / ``retry_message_id`` fork the conversation at
        that message (``message`` is None for a retry). With ``output_schema``
        (a JSON Schema) the turn ends with a ``result`` event holding the
        answer, validated (``until_done().result``); ``create_execution``
        takes it in its spec too. ``webhook`` (``{"url", "events"?}``) has the
        engine POST the turn's end, signed, there too (the engine's README,
        Completion webhooks).

        The request carries an ``Idempotency-Key`` (``idempotency_key``, else a
        new UUID): a request whose answer was lost is sent again with it, and
        the engine runs the message once.
        """
        options = _options(locals())
        body = _api.execute_body(message, options)
        task = options.get("task_id")
        resumer = Resumer(
            body=body, task_id=task, reconnect=self.reconnect, idempotency_key=idempotency_key
        )
        return self._open(resumer)

    def replay(self, task_id: str, *, after: int = 0, after_timestamp: int | None = None) -> S:
        """The task's events after seq ``after`` (or epoch-ms ``after_timestamp``),
        then those of the turn running now, to its end."""
        return self._open(
            Resumer(
                task_id=task_id,
                after_seq=after,
                after_timestamp=after_timestamp,
                reconnect=self.reconnect,
            )
        )

    def follow(self, task_id: str, turn_id: str) -> S:
        """One turn of the task from its start to its end, e.g. the one a 409
        ``TURN_IN_PROGRESS`` or ``HITL_REQUIRED`` names in ``details["turn_id"]``."""
        return self._open(Resumer(task_id=task_id, turn_id=turn_id, reconnect=self.reconnect))

    cancel = _Operation(_api.cancel)
    pending = _Operation(_api.pending)
    answer = _Operation(_api.answer)

    # -- tasks -------------------------------------------------------------------------

    list_tasks = _Operation(_api.list_tasks)
    get_task = _Operation(_api.get_task)
    task_messages = _Operation(_api.task_messages)
    delete_task = _Operation(_api.delete_task)
    working_memory = _Operation(_api.working_memory)

    # -- a task's files, and a checkpoint's --------------------------------------------

    list_files = _Operation(_api.list_files)
    download_file = _Operation(_api.download_file)
    upload_file = _Operation(_api.upload_file)
    delete_file = _Operation(_api.delete_file)
    list_checkpoint_files = _Operation(_api.list_checkpoint_files)
    download_checkpoint_file = _Operation(_api.download_checkpoint_file)

    # -- agents, skills, assets --------------------------------------------------------

    list_agents = _Operation(_api.list_agents)
    get_agent = _Operation(_api.get_agent)
    create_agent = _Operation(_api.create_agent)
    replace_agent = _Operation(_api.replace_agent)
    delete_agent = _Operation(_api.delete_agent)
    list_skills = _Operation(_api.list_skills)
    get_skill = _Operation(_api.get_skill)
    create_skill = _Operation(_api.create_skill)
    delete_skill = _Operation(_api.delete_skill)
    list_servers = _Operation(_api.list_servers)
    get_server = _Operation(_api.get_server)
    server_tools = _Operation(_api.server_tools)
    register_server = _Operation(_api.register_server)
    delete_server = _Operation(_api.delete_server)
    connect_server = _Operation(_api.connect_server)

    # -- memory and learning -----------------------------------------------------------

    search_memory = _Operation(_api.search_memory)
    save_fact = _Operation(_api.save_fact)
    get_fact = _Operation(_api.get_fact)
    delete_fact = _Operation(_api.delete_fact)
    get_soul = _Operation(_api.get_soul)
    put_soul = _Operation(_api.put_soul)
    soul_versions = _Operation(_api.soul_versions)
    export_memory = _Operation(_api.export_memory)
    import_memory = _Operation(_api.import_memory)
    forget_memory = _Operation(_api.forget_memory)
    learning_status = _Operation(_api.learning_status)
    health = _Operation(_api.health)

    # -- executions (/v1/execution) ----------------------------------------------------

    create_execution = _Operation(_api.create_execution)
    get_execution = _Operation(_api.get_execution)
    list_executions = _Operation(_api.list_executions)
    checkpoint_execution = _Operation(_api.checkpoint_execution)
    pause_execution = _Operation(_api.pause_execution)
    resume_execution = _Operation(_api.resume_execution)
    delete_execution = _Operation(_api.delete_execution)


class Client(_Base[TurnStream, httpx.Client]):
    """A blocking client of one Holdfast engine.

    ``url`` defaults to ``HOLDFAST_URL`` or http://127.0.0.1:8000, ``key``
    to ``HOLDFAST_API_KEY`` or the key ``holdfast up`` saved
    (``~/.holdfast/api-key``). Every error answer raises :class:`HoldfastError`.
    """

    def _connect(self, settings: dict[str, Any]) -> httpx.Client:
        return httpx.Client(**settings)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _open(self, resumer: Resumer) -> TurnStream:
        return TurnStream(self, resumer)

    def _sender(self, build: Callable[P, Call[T]]) -> Callable[P, T]:
        @functools.wraps(build)
        def send(*args: P.args, **kwargs: P.kwargs) -> T:
            call = build(*args, **kwargs)
            with _connection_errors():
                response = self.http.request(call.method, call.path, **_request_args(call))
            return _answer(call, response)

        return send


class AsyncClient(_Base[AsyncTurnStream, httpx.AsyncClient]):
    """:class:`Client` for asyncio: the same methods, awaited; streams with ``async for``."""

    def _connect(self, settings: dict[str, Any]) -> httpx.AsyncClient:
        return httpx.AsyncClient(**settings)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    def _open(self, resumer: Resumer) -> AsyncTurnStream:
        return AsyncTurnStream(self, resumer)

    def _sender(self, build: Callable[P, Call[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        @functools.wraps(build)
        async def send(*args: P.args, **kwargs: P.kwargs) -> T:
            call = build(*args, **kwargs)
            with _connection_errors():
                response = await self.http.request(call.method, call.path, **_request_args(call))
            return _answer(call, response)

        return send
