"""MCP connectors: an Asset Directory tool call's round trip on a reused session,
beyond the MCP server's own time, against the same call made directly with the SDK.

The server is the Python SDK's ``MCPServer`` over streamable HTTP (uvicorn, in a
process of its own: :func:`serve`) with one read-only tool, ``ping``, that answers
at once with the time its request has spent in the server so far. An ASGI wrapper
stamps each ``tools/call`` (``perf_counter`` when the request reached the app and
when the answer's last bytes went to the socket, and which session it came on:
the handshakes counted so far) and hands the stamps out at ``GET /_bench/stamps``.
That interval is the server's own time, subtracted from each round trip below.

* Raw baseline: the SDK's ``ClientSession`` over ``streamable_http_client``, one
  session, the calls one after another, in this process on the stdlib asyncio
  loop (as the tool-runner runs); alternating with them, the same calls on the
  SDK's ``Client``, what the runner uses.
* Engine: the server registered for the bench tenant (``POST /assets/servers``),
  an agent with ``"servers": [it]`` (``POST /agents``), one task. A tool-runner
  keeps a task's session with an HTTP server across the task's turns (only a
  stdio server's ends with the turn), so after warm-up turns every call is on
  one session: turns of 11 calls of the tool (one scripted model answer), which
  the loop-worker runs one after another. Every ``tool_call`` frame of a turn
  reaches the client before its first call runs, so a call's round trip is the
  time from the client receiving the previous call's ``tool_result`` frame to
  receiving this one's; the first call of a turn is timed from the last
  ``tool_call`` frame and reported apart. The
  loop-worker and tool-runner are instrumented (``bench.instrument``), so the
  round trip is also split into steps on one clock.
* Stdio, kept across turns (issue #31): the same tool served by the same SDK
  over stdio (:func:`serve_stdio`, this interpreter and repository allowed
  read-only in the sandbox through ``HOLDFAST_ASSET_STDIO_PATHS``), registered as
  a stdio server; one task, turns of 11 calls. Each turn's first call is what a
  restart per turn used to cost (0.8-4.3 s for a node or Python server); the
  server answers with its pid, so the row says how many processes served the
  timed turns (one: kept). Its own time is not subtracted (the tool does nothing).
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.context import Context, run_async
from bench.instrument import ENV as SPANS_ENV
from bench.instrument import RUNNER_CODE, Spans
from bench.scenarios import new_client, percentile, script
from bench.sse import Frames, StreamError, stream_frames
from bench.table import Row

TARGET_MCP_ROUND_TRIP_MS = 10.0
TOOL = "ping"
STAMPS_PATH = "/_bench/stamps"
WARMUP_CALLS = 5
RAW_OPENINGS = 10


# -- the MCP server (runs in its own process) ---------------------------------------------------
# The requests that open an MCP session: the 2026-07-28 protocol's discover, or
# the older initialize. The server counts them, so each call's stamp says which
# session it came on (the newer protocol has no session id header).
HANDSHAKES = frozenset({"server/discover", "initialize"})


class _Stamping:
    """ASGI wrapper of the SDK's app: stamps each ``tools/call`` by its ``tag``
    argument; ``GET /_bench/stamps`` returns the stamps and clears them."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.stamps: dict[str, dict[str, Any]] = {}
        self.sessions = 0  # handshakes so far

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = time.perf_counter()
        if scope["path"] == STAMPS_PATH:
            body, self.stamps = json.dumps(self.stamps).encode(), {}
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        messages: list[dict[str, Any]] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        pending = iter(messages)

        async def replayed() -> Any:
            return next(pending, None) or await receive()

        method, tag = _request(b"".join(m.get("body", b"") for m in messages))
        if method in HANDSHAKES:
            self.sessions += 1
        if tag is None:
            await self.app(scope, replayed, send)
            return
        client = scope.get("client") or ("", 0)
        stamp = {"arrived": arrived, "session": self.sessions, "connection": client[1]}
        self.stamps[tag] = stamp

        async def timed(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and message.get("body"):
                stamp["answered"] = time.perf_counter()

        await self.app(scope, replayed, timed)


def _request(body: bytes) -> tuple[str | None, str | None]:
    """A JSON-RPC request's method, and its ``tag`` argument if it is a ``tools/call``."""
    try:
        request = json.loads(body)
    except ValueError:
        return None, None
    if not isinstance(request, dict):
        return None, None
    method = request.get("method")
    if method != "tools/call":
        return method, None
    tag = ((request.get("params") or {}).get("arguments") or {}).get("tag")
    return method, None if tag is None else str(tag)


def serve() -> None:
    """Entry point of the server process: prints its MCP URL once it listens, then
    serves until SIGTERM."""
    import uvicorn
    from mcp.server.mcpserver import MCPServer
    from mcp_types import ToolAnnotations

    server = MCPServer("hfbench", log_level="WARNING")
    app = _Stamping(server.streamable_http_app())

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def ping(tag: str) -> dict[str, Any]:
        """Answers at once, with the time its request has spent in this server."""
        arrived = app.stamps.get(tag, {}).get("arrived")
        spent = (time.perf_counter() - arrived) * 1000 if arrived else None
        return {"tag": tag, "server_ms": spent}

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # As uvicorn runs by default: httptools and uvloop where installed.
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", http="auto"))

    async def main() -> None:
        task = asyncio.create_task(uv.serve(sockets=[sock]))
        while not uv.started:
            if task.done():
                task.result()
                raise RuntimeError("the MCP server stopped before it started")
            await asyncio.sleep(0.01)
        print(f"http://127.0.0.1:{port}/mcp", flush=True)
        await task

    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())


SERVER_CODE = "from bench.phases.mcp import serve; serve()"


def serve_stdio() -> None:
    """Entry point of the stdio server (started by the tool-runner in the sandbox)."""
    import os

    from mcp.server.mcpserver import MCPServer
    from mcp_types import ToolAnnotations

    server = MCPServer("hfbench-stdio", log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def ping(tag: str) -> dict[str, Any]:
        """Answers at once, with the serving process's pid."""
        return {"tag": tag, "pid": os.getpid()}

    server.run("stdio")


STDIO_SERVER_CODE = "from bench.phases.mcp import serve_stdio; serve_stdio()"


def stdio_paths() -> list[str]:
    """What the stdio server's sandbox must see: this repository (the venv and
    ``bench``) and the interpreter the venv's python links to."""
    import sys
    from pathlib import Path

    return sorted({str(Path(__file__).resolve().parents[2]), sys.base_prefix})


def _root(url: str) -> str:
    return url.rsplit("/", 1)[0]


async def fetch_stamps(server_url: str) -> dict[str, dict[str, Any]]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(_root(server_url) + STAMPS_PATH)
        response.raise_for_status()
        return dict(response.json())


def _server_ms(stamps: dict[str, dict[str, Any]], tag: str) -> float:
    stamp = stamps.get(tag)
    if stamp is None or "answered" not in stamp:
        raise StreamError(f"the MCP server has no stamps for call {tag}")
    return float(stamp["answered"] - stamp["arrived"]) * 1000


# -- the raw baseline: the SDK straight to the server ----------------------------------------
@dataclass
class Raw:
    session_ms: list[float] = field(default_factory=list)  # ClientSession.call_tool
    client_ms: list[float] = field(default_factory=list)  # Client.call_tool
    server_ms: list[float] = field(default_factory=list)  # the server's own, of the former
    # A new Client (its own HTTP client, the handshake) and its first call.
    opening_ms: list[float] = field(default_factory=list)


async def _timed(call: Callable[[str], Awaitable[Any]], tag: str) -> float:
    t0 = time.perf_counter()
    result = await call(tag)
    elapsed = (time.perf_counter() - t0) * 1000
    if getattr(result, "is_error", False):
        raise StreamError(f"the raw {TOOL} call failed: {result}")
    return elapsed


async def raw_calls(server_url: str, calls: int, warmup: int = WARMUP_CALLS) -> Raw:
    """The tool called directly, ``calls`` times on one ``ClientSession`` and on one
    ``Client``, alternating."""
    from mcp import Client
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    out = Raw()
    tags: list[str] = []
    await fetch_stamps(server_url)  # clear what came before
    async with (
        streamable_http_client(server_url) as (read, write),
        ClientSession(read, write) as session,
        Client(server_url) as client,
    ):
        await session.initialize()
        for i in range(warmup + calls):
            by_session = await _timed(lambda tag: session.call_tool(TOOL, {"tag": tag}), f"s{i}")
            by_client = await _timed(lambda tag: client.call_tool(TOOL, {"tag": tag}), f"c{i}")
            if i >= warmup:
                out.session_ms.append(by_session)
                out.client_ms.append(by_client)
                tags.append(f"s{i}")
    stamps = await fetch_stamps(server_url)
    out.server_ms = [_server_ms(stamps, tag) for tag in tags]
    for i in range(RAW_OPENINGS):
        t0 = time.perf_counter()
        async with Client(server_url) as client:
            await client.call_tool(TOOL, {"tag": f"o{i}"})
            out.opening_ms.append((time.perf_counter() - t0) * 1000)
    await fetch_stamps(server_url)
    return out


# -- through the engine -----------------------------------------------------------------------
# Calls a timed turn makes after its first, which opens the turn's session.
REUSED_PER_TURN = 10
WARMUP_TURNS = 2

# Segments of one call's round trip at the client, in order; they add up to it.
SEGMENTS = (
    ("worker: previous result → tool.run (< 0: before the client has it)", "to_tool_run"),
    ("worker: XADD → runner picks the job", "to_runner"),
    ("runner: claim row", "to_call"),
    ("runner: MCP call beyond the server (server row, session, SDK, HTTP)", "client"),
    ("server's own time", "server"),
    ("runner: complete row + XADD reply → worker has it", "after_call"),
    ("worker: emit tool_result → gateway → client", "to_client"),
)


@dataclass
class Timed:
    """Calls timed at the client: ``round_trip_ms`` includes the server's own time."""

    round_trip_ms: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    segments_ms: dict[str, list[float]] = field(
        default_factory=lambda: {key: [] for _, key in SEGMENTS}
    )

    @property
    def beyond_ms(self) -> list[float]:
        return [rt - sv for rt, sv in zip(self.round_trip_ms, self.server_ms, strict=True)]


@dataclass
class Engine:
    reused: Timed  # every call of a turn but its first
    opening: Timed  # the first call of each turn: the runner opens the turn's session
    turns: int
    sessions: int  # sessions the server saw the timed calls on
    strays: int  # reused calls that did not come on their turn's first call's session


@dataclass
class _Call:
    call_id: str
    tag: str
    started: float  # the client got the frame the round trip is timed from
    answered: float  # the client got its tool_result frame


def _calls(got: Frames) -> list[_Call]:
    """The turn's calls in the order they ran, each timed from the frame before its
    result: the previous call's tool_result, or for the first the last tool_call."""
    if got.phase != "completed":
        raise StreamError(f"MCP turn ended {got.phase!r}: {got.types()}")
    tags: dict[str, str] = {}
    last_call = 0.0
    previous: float | None = None
    out: list[_Call] = []
    for name, at, body in got.frames:
        if name == "tool_call":
            tags[body["tool_call_id"]] = str(body["input"]["tag"])
            last_call = at
        elif name == "tool_result":
            if body.get("error") is not None:
                raise StreamError(f"the MCP call failed: {body['error']}")
            call_id = body["tool_call_id"]
            start = previous if previous is not None else last_call
            out.append(_Call(call_id, tags[call_id], start, at))
            previous = at
    return out


def _add(timed: Timed, call: _Call, server_ms: float, spans: Spans | None) -> None:
    timed.round_trip_ms.append((call.answered - call.started) * 1000)
    timed.server_ms.append(server_ms)
    parts = _segments(call, server_ms / 1000, spans) if spans is not None else None
    if parts is not None:
        for key, value in parts.items():
            timed.segments_ms[key].append(value * 1000)


def _segments(call: _Call, server: float, spans: Spans) -> dict[str, float] | None:
    run = spans.of(call.call_id, "tool.run")
    handle = spans.of(call.call_id, "runner.handle")
    mcp = spans.of(call.call_id, "runner.run")
    if not (run and handle and mcp):
        return None
    (run0, run1), (h0, _h1), (m0, m1) = run[0], handle[0], mcp[0]
    return {
        "to_tool_run": run0 - call.started,
        "to_runner": h0 - run0,
        "to_call": m0 - h0,
        "client": m1 - m0 - server,
        "server": server,
        # The runner's handle() also awaits its XADD reply, which the worker may
        # already have read: measured to the worker's side instead.
        "after_call": run1 - m1,
        "to_client": call.answered - run1,
    }


async def _post(client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any]) -> Any:
    response = await client.post(url, json=body, headers={"X-Engine-Key": key})
    if response.status_code != 201:
        raise StreamError(f"POST {url}: HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


async def engine_calls(
    url: str, key: str, server_url: str, reused: int, spans: Spans | None
) -> Engine:
    """Register the server, give an agent its tool, and run the turns on one task:
    enough of them for ``reused`` calls on a reused session."""
    name = f"hfbench-{secrets.token_hex(3)}"
    tool = f"{name}__{TOOL}"
    task_id = f"hfbench-mcp-{secrets.token_hex(4)}"
    turns = max(1, math.ceil(reused / REUSED_PER_TURN))
    async with new_client() as client:
        created = await _post(
            client,
            f"{url}/assets/servers",
            key,
            {"name": name, "transport": "streamable-http", "url": server_url},
        )
        if TOOL not in {t["name"] for t in created.get("tools", [])}:
            raise StreamError(f"the registered MCP server lists no {TOOL!r}: {created}")
        agent = f"{name}-agent"
        await _post(
            client,
            f"{url}/agents",
            key,
            {
                "name": agent,
                "description": "calls the bench's MCP server",
                "system_prompt": "You use the tools of your MCP servers.",
                "servers": [name],
            },
        )

        async def turn(prefix: str) -> list[_Call]:
            calls = [
                {"name": tool, "input": {"tag": f"{prefix}.{i}"}}
                for i in range(1 + REUSED_PER_TURN)
            ]
            body = {
                "message": script(text="", tool_calls=calls),
                "agent": agent,
                "task_id": task_id,
            }
            got = await stream_frames(client, "POST", f"{url}/execute", key=key, json_body=body)
            return _calls(got)

        for i in range(WARMUP_TURNS):  # the task's first turns
            await turn(f"w{i}")
        await fetch_stamps(server_url)  # clear the warm-up's
        timed = [await turn(f"e{i}") for i in range(turns)]
    stamps = await fetch_stamps(server_url)
    if spans is not None:
        spans.reload()
    out = Engine(Timed(), Timed(), turns, 0, 0)
    sessions: set[int] = set()
    for first, *rest in timed:
        _add(out.opening, first, _server_ms(stamps, first.tag), spans)
        session = stamps[first.tag]["session"]
        sessions.add(session)
        for call in rest[: reused - len(out.reused.round_trip_ms)]:
            _add(out.reused, call, _server_ms(stamps, call.tag), spans)
            out.strays += stamps[call.tag]["session"] != session
            sessions.add(stamps[call.tag]["session"])
    out.sessions = len(sessions)
    return out


@dataclass
class Stdio:
    cold_ms: float  # the task's first call: the server starts
    first_ms: list[float] = field(default_factory=list)  # each later turn's first call
    reused_ms: list[float] = field(default_factory=list)  # the other calls
    pids: set[int] = field(default_factory=set)  # processes that served the timed turns


async def stdio_calls(url: str, key: str, turns: int) -> Stdio:
    """Register the stdio server, and run ``turns`` timed turns on one task after
    a first turn that starts it."""
    import sys

    name = f"hfbench-{secrets.token_hex(3)}"
    tool = f"{name}__{TOOL}"
    task_id = f"hfbench-stdio-{secrets.token_hex(4)}"
    async with new_client() as client:
        await _post(
            client,
            f"{url}/assets/servers",
            key,
            {
                "name": name,
                "transport": "stdio",
                "command": sys.executable,
                "args": ["-c", STDIO_SERVER_CODE],
                "env": {"PYTHONPATH": stdio_paths()[-1]},
            },
        )
        agent = f"{name}-agent"
        await _post(
            client,
            f"{url}/agents",
            key,
            {
                "name": agent,
                "description": "calls the bench's stdio MCP server",
                "system_prompt": "You use the tools of your MCP servers.",
                "servers": [name],
            },
        )

        async def turn(prefix: str) -> tuple[list[_Call], set[int]]:
            calls = [
                {"name": tool, "input": {"tag": f"{prefix}.{i}"}}
                for i in range(1 + REUSED_PER_TURN)
            ]
            body = {"message": script(text="", tool_calls=calls), "agent": agent}
            got = await stream_frames(
                client, "POST", f"{url}/execute", key=key, json_body={**body, "task_id": task_id}
            )
            pids = set()
            for frame, _at, event in got.frames:
                if frame == "tool_result":
                    structured = (event.get("output") or {}).get("structuredContent") or {}
                    pids.add(int(structured.get("pid", 0)))
            return _calls(got), pids

        cold, _ = await turn("cold")
        out = Stdio(cold_ms=(cold[0].answered - cold[0].started) * 1000)
        for i in range(turns):
            calls, pids = await turn(f"t{i}")
            out.pids |= pids
            first, *rest = calls
            out.first_ms.append((first.answered - first.started) * 1000)
            out.reused_ms.extend((c.answered - c.started) * 1000 for c in rest)
    return out


# -- the phase ----------------------------------------------------------------------------
def run(ctx: Context) -> list[Row]:
    s, engine, pct = ctx.sizes, ctx.engine, percentile
    rows: list[Row] = []
    label = "MCP tool round trip (Asset Directory, reused session), beyond the server's own time"
    calls = s.tool_turns
    raw = got = None
    with ctx.errors_to(rows, label):
        spans, _provider = ctx.instrumented(1)
        engine.start_tool_runner(
            {
                SPANS_ENV: str(spans.directory),
                "HOLDFAST_ASSET_STDIO_PATHS": json.dumps(stdio_paths()),
            },
            RUNNER_CODE,
        )
        _proc, server_url = engine.start_helper("mcp", SERVER_CODE)
        ctx.say(f"MCP server {server_url} (the SDK's MCPServer, streamable HTTP)")
        ctx.say(f"{label}: raw SDK baseline, {calls} calls on one session")
        raw = run_async(lambda: raw_calls(server_url, calls), False)
        ctx.pause("mcp")
        ctx.say(f"{label}: {calls} calls, {REUSED_PER_TURN} a turn after each turn's first")
        with ctx.measured() as (cpu, pg):
            got = run_async(
                lambda: engine_calls(engine.gateway_url, engine.api_key, server_url, calls, spans),
                ctx.use_uvloop,
            )
    stdio_label = "MCP tool round trip (stdio server kept across the task's turns)"
    stdio = None
    with ctx.errors_to(rows, stdio_label):
        stdio_turns = max(3, math.ceil(calls / REUSED_PER_TURN))
        ctx.say(f"{stdio_label}: {stdio_turns} turns of {1 + REUSED_PER_TURN} calls")
        stdio = run_async(
            lambda: stdio_calls(engine.gateway_url, engine.api_key, stdio_turns), ctx.use_uvloop
        )
    engine.stop_tool_runners()
    _stop_server(ctx)
    if stdio is not None:
        rows.append(_stdio_row(stdio_label, stdio))
    if raw is None or got is None:
        return rows
    reused, opening = got.reused, got.opening
    beyond = pct(reused.beyond_ms, 50)
    raw_p50 = pct(raw.session_ms, 50)
    steps = "; ".join(
        f"{name} {pct(reused.segments_ms[key], 50):.1f}"
        for name, key in SEGMENTS
        if reused.segments_ms[key]
    )
    opened = pct(opening.segments_ms["client"], 50) if opening.segments_ms["client"] else math.nan
    sessions = f"{got.sessions} sessions for {got.turns} turns" + (
        f", {got.strays} call(s) not on their turn's session" if got.strays else ""
    )
    rows.append(
        Row(
            label,
            f"{beyond:.1f} ms p50",
            f"{raw_p50:.1f} ms SDK call",
            f"{pct(reused.round_trip_ms, 50) / raw_p50:.1f}x",
            f"≤ {TARGET_MCP_ROUND_TRIP_MS:g} ms p50",
            f"{len(reused.round_trip_ms)} calls of a read-only tool that answers at once (the "
            f"SDK's MCPServer, streamable HTTP, own process) through a real loop-worker and "
            f"tool-runner, on one task, after {WARMUP_TURNS} warm-up turns: {got.turns} turns of "
            f"{1 + REUSED_PER_TURN} calls, run one after another; the runner keeps the task's "
            f"session across its turns ({sessions}). Per call after a turn's first, "
            f"the client's previous tool_result frame → this call's: p50 "
            f"{pct(reused.round_trip_ms, 50):.1f} ms, p99 {pct(reused.round_trip_ms, 99):.1f} "
            f"ms; minus the server's own time for it (request in → answer out, p50 "
            f"{pct(reused.server_ms, 50):.2f} ms): p50 {beyond:.1f} ms, p99 "
            f"{pct(reused.beyond_ms, 99):.1f} ms. A turn's first call (last tool_call frame → "
            f"its tool_result, after the model step's snapshot) p50 "
            f"{pct(opening.beyond_ms, 50):.1f} ms "
            f"beyond the server, of which the runner's MCP call {opened:.1f} ms. Raw baseline, "
            f"this process on asyncio, one session: ClientSession.call_tool p50 {raw_p50:.1f} "
            f"ms, p99 {pct(raw.session_ms, 99):.1f} ms (server's own p50 "
            f"{pct(raw.server_ms, 50):.2f} ms); Client.call_tool (what the runner calls) p50 "
            f"{pct(raw.client_ms, 50):.1f} ms, and a new Client with its first call p50 "
            f"{pct(raw.opening_ms, 50):.1f} ms over {len(raw.opening_ms)}; the ratio is the "
            f"engine's round trip over ClientSession's. Step by step, reused session, p50 ms "
            f"(instrumented worker and runner, one clock): {steps}. CPU: {cpu.summary()}. "
            f"{pg.summary()}",
            ok=beyond <= TARGET_MCP_ROUND_TRIP_MS,
        )
    )
    return rows


def _stdio_row(label: str, got: Stdio) -> Row:
    pct = percentile
    first = pct(got.first_ms, 50)
    return Row(
        label,
        f"{first:.1f} ms p50",
        f"{got.cold_ms:.0f} ms cold start",
        f"{got.cold_ms / first:.0f}x",
        f"≤ {TARGET_MCP_ROUND_TRIP_MS:g} ms p50 (on a kept session)",
        f"The SDK's MCPServer over stdio in the task's sandbox, registered as a stdio "
        f"server; one task: a first turn starts it (its first call {got.cold_ms:.0f} ms, "
        f"what every turn paid when the turn's end stopped it), then {len(got.first_ms)} "
        f"turns of {1 + REUSED_PER_TURN} calls, served by {len(got.pids)} process(es). "
        f"A later turn's first call (last tool_call frame → its tool_result, after the "
        f"model step's snapshot): p50 {first:.1f} ms, max {max(got.first_ms):.1f} ms; the "
        f"other calls (previous tool_result frame → this one's): p50 "
        f"{pct(got.reused_ms, 50):.1f} ms, p99 {pct(got.reused_ms, 99):.1f} ms over "
        f"{len(got.reused_ms)}. The server's own time is not subtracted (its tool does nothing).",
        ok=len(got.pids) == 1 and pct(got.reused_ms, 50) <= TARGET_MCP_ROUND_TRIP_MS,
    )


def _stop_server(ctx: Context) -> None:
    proc = ctx.engine.helpers.pop("mcp", None)
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
