"""``GET /execute/replay`` straight to its handler, past the framework's per-request layers.

A replay is the connection clients hold longest: a console or a follower
keeps one open for as long as its task runs, and a gateway may hold ten
thousand. Everything on the request's call stack lives as long as the
stream, and most of it is framework plumbing: the router, FastAPI's two
exit stacks and its exception wrappers, the body-limit wrappers — about
12 KB a connection. :class:`ReplayFastLane` (a middleware, inside
Starlette's server-error handler) calls the route function itself for a
request whose parameters it can read exactly as FastAPI would, and renders
an :class:`~holdfast_gateway.errors.ApiError` (or a store outage) through the
app's own exception handlers, so the answer is the same either way.

Anything it is not sure of — a parameter it does not know, one given twice,
a value FastAPI would have to coerce or refuse, a request with a body — goes
down the normal path, which stays the reference (and the OpenAPI
description's source).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl

from holdfast_shared.ids import ID_PATTERN
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from holdfast_gateway.routes import replay
from holdfast_gateway.streamtokens import MAX_TOKEN_CHARS

_PATH = "/execute/replay"
_TASK_ID = re.compile(ID_PATTERN)
_CURSOR = re.compile(r"[0-9]{1,18}")
_LAST_EVENT_ID = re.compile(r"[0-9]{0,18}")
_QUERY = frozenset({"task_id", "after", "after_seq", "token"})


class ReplayFastLane:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != _PATH or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        response = await _respond(scope, receive)
        if response is None:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


async def _respond(scope: Scope, receive: Receive) -> Response | None:
    """The route's response (or its error's); in a frame of its own so that
    nothing it needed is held while the stream lasts."""
    arguments = _arguments(scope)
    if arguments is None:
        return None
    app = scope["app"]
    request = Request(scope, receive)
    try:
        response: Response = await replay.replay(request, app.state.gateway, **arguments)
    except Exception as exc:
        handler = _handler_for(app.exception_handlers, exc)
        if handler is None:
            raise  # the server-error handler answers (500) and logs it
        response = await handler(request, exc)
    return response


def _arguments(scope: Scope) -> dict[str, Any] | None:
    """The route's arguments, or None when only FastAPI's validation may say."""
    query: dict[str, str] = {}
    for name, value in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True):
        if name not in _QUERY or name in query:
            return None
        query[name] = value
    task_id = query.get("task_id")
    if task_id is None or not _TASK_ID.fullmatch(task_id):
        return None
    cursors: dict[str, int | None] = {}
    for name in ("after", "after_seq"):
        raw = query.get(name)
        if raw is not None and not _CURSOR.fullmatch(raw):
            return None
        cursors[name] = None if raw is None else int(raw)
    token = query.get("token")
    if token is not None and not 1 <= len(token) <= MAX_TOKEN_CHARS:
        return None
    headers: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in (b"content-length", b"transfer-encoding"):
            if name == b"transfer-encoding" or value != b"0":
                return None
        if name in (b"last-event-id", b"x-engine-key"):
            if name in headers:
                return None
            headers[name] = value.decode("latin-1")
    last_event_id = headers.get(b"last-event-id")
    if last_event_id is not None and not _LAST_EVENT_ID.fullmatch(last_event_id):
        return None
    return {
        "task_id": task_id,
        "after": cursors["after"],
        "after_seq": cursors["after_seq"],
        "last_event_id": last_event_id,
        "token": token,
        # As FastAPI's APIKeyHeader(auto_error=False): an empty header is none.
        "x_engine_key": headers.get(b"x-engine-key") or None,
    }


def _handler_for(handlers: dict[Any, Any], exc: Exception) -> Any:
    """The app's handler for ``exc`` as Starlette picks it (nearest class first),
    leaving out the catch-all that the server-error handler calls itself."""
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return handlers[cls]
    return None
