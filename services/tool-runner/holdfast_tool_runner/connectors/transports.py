"""How a session reaches its server: the SDK's streamable-HTTP transport, or a
stdio server running in the sandbox.

The SDK's own ``stdio_client`` starts the server as a plain child of this
process; here it must run inside the task's sandbox (``sandbox/resident.py``),
so :func:`resident_transport` bridges the sandboxed process's pipes to the
session's streams the way ``stdio_client`` does: newline-delimited JSON-RPC,
each line parsed by the SDK's own message adapter. The protocol above the
pipes — initialization, requests, notifications — is the SDK's ``Client``.

An HTTP server gets an ``httpx2`` client carrying its credentials: a bearer
token as a header, or :class:`~holdfast_tool_runner.connectors.oauthbearer.StoredOAuth`; its
transport is the outbound policy's (``holdfast_shared.outbound``), so the
server's URL, its token endpoint and any redirect are judged as they are
dialled, and dialled at the address judged.

A tool call carries its idempotency key in the request's ``_meta``
(:data:`IDEMPOTENCY_META`); over HTTP it also goes as the ``Idempotency-Key``
header (:func:`_idempotency_header`), which a server's gateway or framework
can dedupe on without reading the JSON-RPC body.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx2
import mcp_types
from holdfast_shared.outbound import OutboundPolicy
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.message import SessionMessage

from holdfast_tool_runner.sandbox import Resident

log = logging.getLogger(__name__)

# One message (a line) larger than this ends the session: a runaway server
# must not grow this process without bound.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_CHUNK = 64 * 1024
# Where a tools/call request carries the call's idempotency key.
IDEMPOTENCY_META = "io.holdfast/idempotency-key"
IDEMPOTENCY_HEADER = "Idempotency-Key"
# How much of a stdio server's stderr is kept: the end, where a failed start says why.
STDERR_TAIL_BYTES = 4096


class StderrTail:
    """The last :data:`STDERR_TAIL_BYTES` a stdio server wrote to stderr.

    Kept only to say why a server failed to start or died (in a registration's
    422 and the runner's log, redacted of the server's secrets first); the rest
    is read and dropped."""

    def __init__(self, limit: int = STDERR_TAIL_BYTES) -> None:
        self.limit = limit
        self._data = bytearray()
        self.ended = anyio.Event()

    def feed(self, chunk: bytes) -> None:
        self._data += chunk
        if len(self._data) > self.limit:
            del self._data[: len(self._data) - self.limit]

    def text(self) -> str:
        return self._data.decode(errors="replace").strip()

    async def settled(self, seconds: float) -> str:
        """The tail once the server closed its stderr (or after ``seconds``):
        a process that just died may still have a line in the pipe."""
        with anyio.move_on_after(seconds):
            await self.ended.wait()
        return self.text()


def _meta_key(body: bytes) -> str | None:
    """The idempotency key in a JSON-RPC request's ``params._meta``, if any."""
    if IDEMPOTENCY_META.encode() not in body:
        return None  # most requests: no need to parse them
    try:
        message: Any = json.loads(body)
    except ValueError:
        return None
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    key = meta.get(IDEMPOTENCY_META) if isinstance(meta, dict) else None
    return key if isinstance(key, str) else None


async def _idempotency_header(request: httpx2.Request) -> None:
    """Copy a tool call's ``_meta`` key into the ``Idempotency-Key`` header. The SDK
    posts from its own task, so the body is the one place the key is sure to be."""
    if request.method == "POST":
        key = _meta_key(request.content)
        if key is not None:
            request.headers[IDEMPOTENCY_HEADER] = key


def _parse(line: bytes) -> SessionMessage | Exception:
    try:
        message = mcp_types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    except ValueError as exc:
        return exc
    return SessionMessage(message)


@contextlib.asynccontextmanager
async def resident_transport(
    resident: Resident, stderr: StderrTail | None = None
) -> AsyncIterator[TransportStreams]:
    """The session's streams over ``resident``'s stdin and stdout; the process is
    stopped when the context ends (and the streams end when it dies). What it
    writes to stderr goes to ``stderr`` (its tail), else nowhere."""
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)

    async def stdout_reader() -> None:
        buffer = b""
        async with read_writer:
            while chunk := await resident.stdout.read(_CHUNK):
                *lines, buffer = (buffer + chunk).split(b"\n")
                if len(buffer) > MAX_MESSAGE_BYTES:
                    await read_writer.send(ValueError("the server sent an oversized message"))
                    return
                for line in lines:
                    if line.strip():
                        await read_writer.send(_parse(line))

    async def stdin_writer() -> None:
        try:
            async with write_reader:
                async for message in write_reader:
                    data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    resident.stdin.write(data.encode() + b"\n")
                    await resident.stdin.drain()
        except (OSError, anyio.ClosedResourceError, anyio.BrokenResourceError):
            await read_writer.aclose()  # the server is gone: the session sees the end

    async def stderr_drain() -> None:
        # Only the tail is kept (see StderrTail), and it may hold the server's
        # secrets: whoever shows it redacts it.
        try:
            while chunk := await resident.stderr.read(_CHUNK):
                if stderr is not None:
                    stderr.feed(chunk)
        finally:
            if stderr is not None:
                stderr.ended.set()

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(stdout_reader)
            group.start_soon(stdin_writer)
            group.start_soon(stderr_drain)
            try:
                yield read_stream, write_stream
            finally:
                group.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await resident.stop()
            for stream in (read_stream, write_stream, read_writer, write_reader):
                await stream.aclose()


@contextlib.asynccontextmanager
async def http_transport(
    url: str,
    *,
    headers: dict[str, str],
    auth: httpx2.Auth | None,
    timeout_seconds: float,
    outbound: OutboundPolicy,
) -> AsyncIterator[TransportStreams]:
    """The SDK's streamable-HTTP transport to ``url`` with these credentials.

    Raises :class:`~holdfast_shared.outbound.DestinationNotAllowed` before
    anything is sent if the policy refuses ``url``: the SDK's transport would
    only log a refusal from inside its tasks."""
    await outbound.check_url(url, ("url",))
    client = httpx2.AsyncClient(
        headers=headers,
        auth=auth,
        timeout=httpx2.Timeout(timeout_seconds, read=max(timeout_seconds, 300.0)),
        transport=outbound.transport(("url",)),
        event_hooks={"request": [_idempotency_header]},
    )
    async with client, streamable_http_client(url, http_client=client) as streams:
        yield streams
