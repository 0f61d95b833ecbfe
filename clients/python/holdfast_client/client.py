"""``Client`` (blocking) and ``AsyncClient`` (asyncio): the same API, the same logic.

What a stream does is decided by :class:`holdfast_client._resume.Resumer`
and what each operation sends and reads by :mod:`holdfast_client._api`;
the two classes only carry out the I/O, each in its own style.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import httpx

from holdfast_client import _api
from holdfast_client._api import Call, JsonObject, MemoryKind, PendingRequest
from holdfast_client._resume import DEFAULT_RECONNECT, Attempt, Reconnect, Resumer
from holdfast_client._sse import FrameDecoder
from holdfast_client.errors import HoldfastError
from holdfast_client.events import Event
from holdfast_client.text import TurnText

T = TypeVar("T")

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
)


def _options(arguments: dict[str, Any]) -> dict[str, Any]:
    """The ``POST /execute`` fields among a ``stream`` call's arguments."""
    return {name: arguments[name] for name in _STREAM_OPTIONS}


def _checked(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise HoldfastError.from_response(response, response.content)


class TurnStream:
    """The events of one turn (or replay), each once and in order; iterate it once.

    ``task_id`` and ``turn_id`` are known as soon as the engine answered,
    ``last_seq`` is the seq of the last event yielded (the cursor to replay
    after), ``transcript`` the turn's text so far with discarded deltas
    taken out. Heartbeats are not yielded.
    """

    def __init__(self, client: Client, resumer: Resumer) -> None:
        self._client = client
        self._resumer = resumer
        self.transcript = TurnText()
        self._events = self._run()

    @property
    def task_id(self) -> str | None:
        return self._resumer.task_id

    @property
    def turn_id(self) -> str | None:
        return self._resumer.turn_id

    @property
    def last_seq(self) -> int:
        return self._resumer.last_seq

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
            try:
                with http.stream(attempt.method, attempt.path, **_request_args(attempt)) as resp:
                    if resp.status_code >= 300:
                        wait = r.refused(resp, resp.read())
                    else:
                        r.opened(resp)
                        frames = FrameDecoder()
                        for chunk in resp.iter_bytes():
                            for sse in frames.feed(chunk):
                                event = r.feed(sse)
                                if event is not None:
                                    self.transcript.feed(event)
                                    yield event
                                    if r.done:
                                        return
                        finished = r.ended()
                        if finished is None:
                            return
                        wait = finished
            except httpx.TransportError as exc:
                wait = r.lost(exc)
            time.sleep(wait)


class AsyncTurnStream:
    """:class:`TurnStream` for :class:`AsyncClient`: iterate it with ``async for``."""

    def __init__(self, client: AsyncClient, resumer: Resumer) -> None:
        self._client = client
        self._resumer = resumer
        self.transcript = TurnText()
        self._events = self._run()

    @property
    def task_id(self) -> str | None:
        return self._resumer.task_id

    @property
    def turn_id(self) -> str | None:
        return self._resumer.turn_id

    @property
    def last_seq(self) -> int:
        return self._resumer.last_seq

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
                            for sse in frames.feed(chunk):
                                event = r.feed(sse)
                                if event is not None:
                                    self.transcript.feed(event)
                                    yield event
                                    if r.done:
                                        return
                        finished = r.ended()
                        if finished is None:
                            return
                        wait = finished
            except httpx.TransportError as exc:
                wait = r.lost(exc)
            await asyncio.sleep(wait)


class _Base:
    """Arguments and stream set-up shared by both clients."""

    def __init__(self, reconnect: Reconnect) -> None:
        self.reconnect = reconnect

    def _turn(self, message: str | None, options: dict[str, Any]) -> Resumer:
        body = _api.execute_body(message, options)
        return Resumer(body=body, task_id=options.get("task_id"), reconnect=self.reconnect)

    def _follow(self, task_id: str, turn_id: str) -> Resumer:
        return Resumer(task_id=task_id, turn_id=turn_id, reconnect=self.reconnect)

    def _replay(self, task_id: str, after: int, after_timestamp: int | None) -> Resumer:
        return Resumer(
            task_id=task_id,
            after_seq=after,
            after_timestamp=after_timestamp,
            reconnect=self.reconnect,
        )


class Client(_Base):
    """A blocking client of one Holdfast engine.

    ``url`` defaults to ``HOLDFAST_URL`` or http://127.0.0.1:8000, ``key``
    to ``HOLDFAST_API_KEY`` or the key ``holdfast up`` saved
    (``~/.holdfast/api-key``). Every error answer raises :class:`HoldfastError`.
    """

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        stream_read_timeout: float = DEFAULT_STREAM_READ_TIMEOUT,
        reconnect: Reconnect = DEFAULT_RECONNECT,
        http: httpx.Client | None = None,
    ) -> None:
        super().__init__(reconnect)
        self.http = http or httpx.Client(**_settings(url, key, timeout, stream_read_timeout))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _do(self, call: Call[T]) -> T:
        try:
            response = self.http.request(call.method, call.path, **_request_args(call))
        except httpx.TransportError as exc:
            raise HoldfastError(None, "CONNECTION_FAILED", repr(exc)) from exc
        _checked(response)
        return call.read(response)

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
    ) -> TurnStream:
        """Send ``message`` (to ``task_id``, or a new task) and stream the turn.

        The request is sent when iteration starts. A dropped connection is
        resumed from the last event yielded, so every event comes once, in
        order, up to the turn's terminal ``thread_lifecycle``. ``on_busy``
        says what a message for a task with a running turn does (``reject``,
        ``enqueue``, ``interrupt``, ``steer``: see the engine's README);
        ``edit_message_id`` / ``retry_message_id`` fork the conversation at
        that message (``message`` is None for a retry).
        """
        return TurnStream(self, self._turn(message, _options(locals())))

    def replay(
        self, task_id: str, *, after: int = 0, after_timestamp: int | None = None
    ) -> TurnStream:
        """The task's events after seq ``after`` (or epoch-ms ``after_timestamp``),
        then those of the turn running now, to its end."""
        return TurnStream(self, self._replay(task_id, after, after_timestamp))

    def follow(self, task_id: str, turn_id: str) -> TurnStream:
        """One turn of the task from its start to its end, e.g. the one a 409
        ``TURN_IN_PROGRESS`` or ``HITL_REQUIRED`` names in ``details["turn_id"]``."""
        return TurnStream(self, self._follow(task_id, turn_id))

    def cancel(self, task_id: str) -> JsonObject:
        return self._do(_api.cancel(task_id))

    def pending(self, task_id: str | None = None) -> list[PendingRequest]:
        """Permission prompts and questions waiting for an answer (of one task, or all)."""
        return self._do(_api.pending(task_id))

    def answer(
        self,
        task_id: str,
        answer: str,
        *,
        request_id: str | None = None,
        feedback: str | None = None,
        content_blocks: list[Mapping[str, Any]] | None = None,
    ) -> JsonObject:
        """Answer a pending request (``yes``/``no`` for a permission prompt)."""
        return self._do(_api.answer(task_id, answer, request_id, feedback, content_blocks))

    # -- tasks --------------------------------------------------------------------------

    def list_tasks(self, **params: str | int | None) -> JsonObject:
        return self._do(_api.list_tasks(params))

    def get_task(self, task_id: str) -> JsonObject:
        return self._do(_api.get_task(task_id))

    def task_messages(self, task_id: str, **params: str | int | None) -> JsonObject:
        return self._do(_api.task_messages(task_id, params))

    def delete_task(self, task_id: str) -> JsonObject:
        return self._do(_api.delete_task(task_id))

    def working_memory(self, task_id: str) -> dict[str, str]:
        return self._do(_api.working_memory(task_id))

    # -- agents, skills, assets -----------------------------------------------------------

    def list_agents(self) -> JsonObject:
        return self._do(_api.list_agents())

    def get_agent(self, name: str) -> JsonObject:
        return self._do(_api.get_agent(name))

    def create_agent(self, spec: Mapping[str, Any]) -> JsonObject:
        return self._do(_api.create_agent(spec))

    def replace_agent(self, name: str, spec: Mapping[str, Any]) -> JsonObject:
        return self._do(_api.replace_agent(name, spec))

    def delete_agent(self, name: str) -> None:
        self._do(_api.delete_agent(name))

    def list_skills(self) -> JsonObject:
        return self._do(_api.list_skills())

    def get_skill(self, name: str) -> JsonObject:
        return self._do(_api.get_skill(name))

    def create_skill(self, skill: Mapping[str, Any] | bytes) -> JsonObject:
        return self._do(_api.create_skill(skill))

    def delete_skill(self, name: str) -> None:
        self._do(_api.delete_skill(name))

    def list_servers(self) -> JsonObject:
        return self._do(_api.list_servers())

    def get_server(self, name: str) -> JsonObject:
        return self._do(_api.get_server(name))

    def server_tools(self, name: str) -> JsonObject:
        return self._do(_api.server_tools(name))

    def register_server(self, spec: Mapping[str, Any]) -> JsonObject:
        return self._do(_api.register_server(spec))

    def delete_server(self, name: str) -> None:
        self._do(_api.delete_server(name))

    def connect_server(self, name: str) -> JsonObject:
        return self._do(_api.connect_server(name))

    # -- memory and learning --------------------------------------------------------------

    def search_memory(
        self, kind: MemoryKind, query: str, *, limit: int | None = None, user_id: str | None = None
    ) -> JsonObject:
        return self._do(_api.search_memory(kind, query, limit, user_id))

    def save_fact(self, text: str, *, user_id: str | None = None, **extra: Any) -> JsonObject:
        return self._do(_api.save_fact(text, user_id, extra))

    def get_fact(self, fact_id: str, *, user_id: str | None = None) -> JsonObject:
        return self._do(_api.get_fact(fact_id, user_id))

    def delete_fact(self, fact_id: str, *, user_id: str | None = None) -> None:
        self._do(_api.delete_fact(fact_id, user_id))

    def get_soul(self, *, user_id: str | None = None) -> JsonObject:
        return self._do(_api.get_soul(user_id))

    def put_soul(self, content: str, *, user_id: str | None = None) -> JsonObject:
        return self._do(_api.put_soul(content, user_id))

    def soul_versions(self, *, user_id: str | None = None) -> JsonObject:
        return self._do(_api.soul_versions(user_id))

    def export_memory(self, *, user_id: str | None = None) -> bytes:
        return self._do(_api.export_memory(user_id))

    def import_memory(self, ndjson: bytes, *, user_id: str | None = None) -> JsonObject:
        return self._do(_api.import_memory(ndjson, user_id))

    def forget_memory(self, *, user_id: str | None = None) -> JsonObject:
        return self._do(_api.forget_memory(user_id))

    def learning_status(self) -> JsonObject:
        return self._do(_api.learning_status())

    def health(self) -> JsonObject:
        return self._do(_api.health())

    # -- executions (/v1/execution) --------------------------------------------------------

    def create_execution(self, spec: Mapping[str, Any]) -> JsonObject:
        return self._do(_api.create_execution(spec))

    def get_execution(self, execution_id: str) -> JsonObject:
        return self._do(_api.get_execution(execution_id))

    def list_executions(self, **params: str | int | None) -> JsonObject:
        return self._do(_api.list_executions(params))

    def checkpoint_execution(
        self,
        execution_id: str,
        state: Mapping[str, Any] | None = None,
        *,
        label: str | None = None,
    ) -> JsonObject:
        return self._do(_api.checkpoint_execution(execution_id, state, label))

    def pause_execution(self, execution_id: str) -> JsonObject:
        return self._do(_api.pause_execution(execution_id))

    def resume_execution(
        self, execution_id: str, *, checkpoint_id: str | None = None
    ) -> JsonObject:
        return self._do(_api.resume_execution(execution_id, checkpoint_id))

    def delete_execution(self, execution_id: str) -> JsonObject:
        return self._do(_api.delete_execution(execution_id))


class AsyncClient(_Base):
    """:class:`Client` for asyncio: the same methods, awaited; streams with ``async for``."""

    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        stream_read_timeout: float = DEFAULT_STREAM_READ_TIMEOUT,
        reconnect: Reconnect = DEFAULT_RECONNECT,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(reconnect)
        self.http = http or httpx.AsyncClient(**_settings(url, key, timeout, stream_read_timeout))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, _t: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _do(self, call: Call[T]) -> T:
        try:
            response = await self.http.request(call.method, call.path, **_request_args(call))
        except httpx.TransportError as exc:
            raise HoldfastError(None, "CONNECTION_FAILED", repr(exc)) from exc
        _checked(response)
        return call.read(response)

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
    ) -> AsyncTurnStream:
        """See :meth:`Client.stream`."""
        return AsyncTurnStream(self, self._turn(message, _options(locals())))

    def replay(
        self, task_id: str, *, after: int = 0, after_timestamp: int | None = None
    ) -> AsyncTurnStream:
        """See :meth:`Client.replay`."""
        return AsyncTurnStream(self, self._replay(task_id, after, after_timestamp))

    def follow(self, task_id: str, turn_id: str) -> AsyncTurnStream:
        """See :meth:`Client.follow`."""
        return AsyncTurnStream(self, self._follow(task_id, turn_id))

    async def cancel(self, task_id: str) -> JsonObject:
        return await self._do(_api.cancel(task_id))

    async def pending(self, task_id: str | None = None) -> list[PendingRequest]:
        return await self._do(_api.pending(task_id))

    async def answer(
        self,
        task_id: str,
        answer: str,
        *,
        request_id: str | None = None,
        feedback: str | None = None,
        content_blocks: list[Mapping[str, Any]] | None = None,
    ) -> JsonObject:
        return await self._do(_api.answer(task_id, answer, request_id, feedback, content_blocks))

    # -- tasks --------------------------------------------------------------------------

    async def list_tasks(self, **params: str | int | None) -> JsonObject:
        return await self._do(_api.list_tasks(params))

    async def get_task(self, task_id: str) -> JsonObject:
        return await self._do(_api.get_task(task_id))

    async def task_messages(self, task_id: str, **params: str | int | None) -> JsonObject:
        return await self._do(_api.task_messages(task_id, params))

    async def delete_task(self, task_id: str) -> JsonObject:
        return await self._do(_api.delete_task(task_id))

    async def working_memory(self, task_id: str) -> dict[str, str]:
        return await self._do(_api.working_memory(task_id))

    # -- agents, skills, assets -----------------------------------------------------------

    async def list_agents(self) -> JsonObject:
        return await self._do(_api.list_agents())

    async def get_agent(self, name: str) -> JsonObject:
        return await self._do(_api.get_agent(name))

    async def create_agent(self, spec: Mapping[str, Any]) -> JsonObject:
        return await self._do(_api.create_agent(spec))

    async def replace_agent(self, name: str, spec: Mapping[str, Any]) -> JsonObject:
        return await self._do(_api.replace_agent(name, spec))

    async def delete_agent(self, name: str) -> None:
        await self._do(_api.delete_agent(name))

    async def list_skills(self) -> JsonObject:
        return await self._do(_api.list_skills())

    async def get_skill(self, name: str) -> JsonObject:
        return await self._do(_api.get_skill(name))

    async def create_skill(self, skill: Mapping[str, Any] | bytes) -> JsonObject:
        return await self._do(_api.create_skill(skill))

    async def delete_skill(self, name: str) -> None:
        await self._do(_api.delete_skill(name))

    async def list_servers(self) -> JsonObject:
        return await self._do(_api.list_servers())

    async def get_server(self, name: str) -> JsonObject:
        return await self._do(_api.get_server(name))

    async def server_tools(self, name: str) -> JsonObject:
        return await self._do(_api.server_tools(name))

    async def register_server(self, spec: Mapping[str, Any]) -> JsonObject:
        return await self._do(_api.register_server(spec))

    async def delete_server(self, name: str) -> None:
        await self._do(_api.delete_server(name))

    async def connect_server(self, name: str) -> JsonObject:
        return await self._do(_api.connect_server(name))

    # -- memory and learning --------------------------------------------------------------

    async def search_memory(
        self, kind: MemoryKind, query: str, *, limit: int | None = None, user_id: str | None = None
    ) -> JsonObject:
        return await self._do(_api.search_memory(kind, query, limit, user_id))

    async def save_fact(self, text: str, *, user_id: str | None = None, **extra: Any) -> JsonObject:
        return await self._do(_api.save_fact(text, user_id, extra))

    async def get_fact(self, fact_id: str, *, user_id: str | None = None) -> JsonObject:
        return await self._do(_api.get_fact(fact_id, user_id))

    async def delete_fact(self, fact_id: str, *, user_id: str | None = None) -> None:
        await self._do(_api.delete_fact(fact_id, user_id))

    async def get_soul(self, *, user_id: str | None = None) -> JsonObject:
        return await self._do(_api.get_soul(user_id))

    async def put_soul(self, content: str, *, user_id: str | None = None) -> JsonObject:
        return await self._do(_api.put_soul(content, user_id))

    async def soul_versions(self, *, user_id: str | None = None) -> JsonObject:
        return await self._do(_api.soul_versions(user_id))

    async def export_memory(self, *, user_id: str | None = None) -> bytes:
        return await self._do(_api.export_memory(user_id))

    async def import_memory(self, ndjson: bytes, *, user_id: str | None = None) -> JsonObject:
        return await self._do(_api.import_memory(ndjson, user_id))

    async def forget_memory(self, *, user_id: str | None = None) -> JsonObject:
        return await self._do(_api.forget_memory(user_id))

    async def learning_status(self) -> JsonObject:
        return await self._do(_api.learning_status())

    async def health(self) -> JsonObject:
        return await self._do(_api.health())

    # -- executions (/v1/execution) --------------------------------------------------------

    async def create_execution(self, spec: Mapping[str, Any]) -> JsonObject:
        return await self._do(_api.create_execution(spec))

    async def get_execution(self, execution_id: str) -> JsonObject:
        return await self._do(_api.get_execution(execution_id))

    async def list_executions(self, **params: str | int | None) -> JsonObject:
        return await self._do(_api.list_executions(params))

    async def checkpoint_execution(
        self,
        execution_id: str,
        state: Mapping[str, Any] | None = None,
        *,
        label: str | None = None,
    ) -> JsonObject:
        return await self._do(_api.checkpoint_execution(execution_id, state, label))

    async def pause_execution(self, execution_id: str) -> JsonObject:
        return await self._do(_api.pause_execution(execution_id))

    async def resume_execution(
        self, execution_id: str, *, checkpoint_id: str | None = None
    ) -> JsonObject:
        return await self._do(_api.resume_execution(execution_id, checkpoint_id))

    async def delete_execution(self, execution_id: str) -> JsonObject:
        return await self._do(_api.delete_execution(execution_id))
