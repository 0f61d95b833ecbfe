"""Every error leaves the gateway as ``{"error": CODE, "message", "details"?}``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from holdfast_shared.errors import ErrorCode
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details
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
    400: ErrorCode.INVALID_REQUEST,
    401: ErrorCode.INVALID_KEY,
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
}


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
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code, f"HTTP_{exc.status_code}")
        return JSONResponse(error_body(str(code), str(exc.detail)), exc.status_code)
