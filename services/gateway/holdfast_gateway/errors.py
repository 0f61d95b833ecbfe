"""Every error leaves the gateway as ``{"error": CODE, "message", "details"?}``.

Also for what FastAPI or Starlette answer themselves (404, 405 with its
``Allow``, 413 from the body limit) and for an unexpected exception (500
``INTERNAL``, logged with its traceback; SQL parameters are never logged,
see ``holdfast_shared.db.engine``). :func:`responses` documents the same
bodies in ``/openapi.json``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from holdfast_shared.errors import ErrorCode, HoldfastError
from holdfast_shared.redisconn import refused_for_memory
from pydantic import BaseModel
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(HoldfastError):
    """An error answered as HTTP ``status`` with the JSON error body."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(code, message, details)
        self.status = status
        self.headers = headers


def error_body(code: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"error": code, "message": message}
    if details:
        body["details"] = details
    return body


def _validation_details(exc: RequestValidationError) -> dict[str, Any]:
    errors = []
    for err in exc.errors():
        errors.append(
            {
                "loc": [str(part) for part in err.get("loc", ())],
                "msg": err.get("msg", ""),
                "type": err.get("type", ""),
            }
        )
    return {"errors": errors}


def _summary(details: dict[str, Any]) -> str:
    parts = [f"{'.'.join(e['loc'][1:]) or 'body'}: {e['msg']}" for e in details["errors"]]
    return "invalid request: " + "; ".join(parts)


_STATUS_CODES = {
    401: ErrorCode.INVALID_KEY,
    404: ErrorCode.NOT_FOUND,
    405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.BODY_TOO_LARGE,
    415: ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    429: ErrorCode.RATE_LIMITED,
}


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: str
    message: str
    details: dict[str, Any] = {}


# What each status means, for the API description; the codes are ErrorCode values.
_DESCRIPTIONS = {
    401: (
        "`INVALID_KEY`: the `X-Engine-Key` header is missing or not a valid API key; "
        "`STREAM_TOKEN_INVALID` / `STREAM_TOKEN_EXPIRED`: a replay's `?token=` is "
        "malformed or not signed by this deployment / has expired"
    ),
    403: "`STREAM_TOKEN_WRONG_TASK`: a replay's `?token=` was issued for another task",
    404: (
        "`TASK_NOT_FOUND` (also for another tenant's task), `HITL_NOT_FOUND`, "
        "`AGENT_NOT_FOUND` (also for another tenant's agent), "
        "`MEMORY_NOT_FOUND` (a fact the brain does not hold, also another tenant's), "
        "`SKILL_NOT_FOUND` (also for another tenant's skill), "
        "`SCHEDULE_NOT_FOUND` (also for another tenant's schedule), "
        "`WEBHOOK_DELIVERY_NOT_FOUND` (also for another tenant's), "
        "`ASSET_NOT_FOUND` (an Asset Directory server, also another tenant's; "
        "or an OAuth callback's unknown state), "
        "`FILE_NOT_FOUND` (a task's file or directory, also one reached through a symlink)"
    ),
    409: (
        "`TURN_IN_PROGRESS`, `HITL_REQUIRED`, `NO_RUNNING_TURN`, `HITL_ALREADY_ANSWERED`, "
        "`TURN_QUEUE_FULL` (`on_busy`: `HOLDFAST_MAX_QUEUED_TURNS` messages already wait), "
        "`AGENT_EXISTS` (the name is taken), `AGENT_BUILTIN` (built-ins cannot change), "
        "`SKILL_EXISTS`, `SKILL_BUILTIN`, `SCHEDULE_EXISTS` (the name is taken), "
        "`ASSET_EXISTS` (the server's name is taken), "
        "`ASSET_NOT_OAUTH2` (connecting a server that does not use oauth2), "
        "`INVALID_PATH` (a task's file path where the workspace holds a directory, "
        "or a file where a directory is meant)"
    ),
    400: (
        "`ASSET_AUTHORIZATION_FAILED`: the OAuth callback's state is unknown or expired, "
        "or the authorization server refused; "
        "`INVALID_PATH`: a task's file path that is absolute, has `.` or `..`, or is too long"
    ),
    410: "`HITL_EXPIRED`: the question expired or its turn ended",
    413: (
        "`BODY_TOO_LARGE`: the body is larger than `HOLDFAST_MAX_BODY_BYTES`; "
        "`SKILL_TOO_LARGE`: a skill over its file count or size caps (`details.limit`); "
        "`WORKSPACE_FULL`: an upload larger than the task's workspace has room for"
    ),
    416: "`RANGE_NOT_SATISFIABLE`: a download's `Range` starts past the file's end",
    415: (
        "`UNSUPPORTED_MEDIA_TYPE`: the body is not `application/json` "
        "(`application/x-ndjson` for `/memory/import`; `application/zip` also for `/skills`)"
    ),
    422: (
        "`INVALID_REQUEST` (`details.errors` names each field), `MODEL_UNAVAILABLE`, "
        "`UNSUPPORTED_MEDIA` (the turn's model cannot take a media type; `details.media_type`), "
        "`ASSET_UNAVAILABLE` (the MCP server named could not be listed; nothing was stored), "
        "`DESTINATION_NOT_ALLOWED` (a URL leads where the engine may not connect: loopback, "
        "private, metadata...; `details.errors` names it)"
    ),
    429: (
        "`RATE_LIMITED`: too many failed API-key checks from this address, or the tenant is "
        "at one of its limits (`details.limit` names the setting); see `Retry-After`"
    ),
    500: "`INTERNAL`: an unexpected error, logged by the gateway",
    507: (
        "`STORAGE_QUOTA_EXCEEDED`: the tenant stores `HOLDFAST_TENANT_MAX_STORAGE_BYTES` or "
        "more (`details.limit_bytes`, `details.used_bytes`); nothing was written"
    ),
    503: "`UNAVAILABLE`: Redis or PostgreSQL is unreachable; retry after `Retry-After`",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route for these error statuses, each with :class:`ErrorBody`."""
    return {
        status: {
            "model": ErrorBody,
            "description": _DESCRIPTIONS[status],
            **({"headers": _RETRY_AFTER} if status in (429, 503) else {}),
        }
        for status in statuses
    }


# Every operation that needs an API key can answer these.
AUTHENTICATED = (401, 422, 429, 500, 503)
# ... and every one with a JSON body these.
WITH_BODY = (413, 415)


def _allowed_methods(request: Request, allow: str) -> str:
    """The methods the API description gives the path of the route that answered 405.

    Starlette's 405 lists the methods of that one route only; a path
    served by several routes (``GET`` and ``PUT /memory/soul``) takes them
    all. ``allow`` (Starlette's) stands for routes the description leaves out.
    """
    path = getattr(request.scope.get("route"), "path_format", None)
    operations = request.app.openapi().get("paths", {}).get(path) if path else None
    if not operations:
        return allow
    return ", ".join(method.upper() for method in operations)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.code, exc.message, exc.details), exc.status, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = _validation_details(exc)
        return JSONResponse(error_body(ErrorCode.INVALID_REQUEST, _summary(details), details), 422)

    async def _unavailable(_: Request, exc: Exception) -> JSONResponse:
        # Redis or PostgreSQL is down or restarting: a clear, retryable answer.
        return JSONResponse(
            error_body(
                ErrorCode.UNAVAILABLE,
                f"a backing store is unavailable, retry shortly ({type(exc).__name__})",
            ),
            503,
            headers={"Retry-After": "1"},
        )

    for store_error in (RedisConnectionError, RedisTimeoutError, OperationalError, InterfaceError):
        app.add_exception_handler(store_error, _unavailable)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:
            # FastAPI's answer to a body it cannot decode (not UTF-8): bad
            # input like any other, so the same 422 as malformed JSON.
            details = {"errors": [{"loc": ["body"], "msg": str(exc.detail), "type": "body"}]}
            return JSONResponse(
                error_body(ErrorCode.INVALID_REQUEST, _summary(details), details), 422
            )
        code = _STATUS_CODES.get(exc.status_code, f"HTTP_{exc.status_code}")
        # The headers matter: 405 carries Allow.
        headers = exc.headers
        if exc.status_code == 405:
            allow = (headers or {}).get("Allow", "")
            headers = {**(headers or {}), "Allow": _allowed_methods(request, allow)}
        return JSONResponse(
            error_body(str(code), str(exc.detail)), exc.status_code, headers=headers
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # Starlette's ServerErrorMiddleware calls this, then re-raises for the
        # server to log with the traceback; the answer says nothing of it.
        if refused_for_memory(exc):
            # Redis full (maxmemory, noeviction: a long PostgreSQL outage leads
            # there): the store's state, not a bug; retryable once it has room.
            return await _unavailable(request, exc)
        return JSONResponse(
            error_body(ErrorCode.INTERNAL, "internal error; the gateway logged it"), 500
        )
