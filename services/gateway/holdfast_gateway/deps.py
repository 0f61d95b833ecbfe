"""FastAPI dependencies: the gateway state, the caller's tenant, a JSON body; and
the look-ups of a tenant's task and agent that answer 404."""

from __future__ import annotations

import email.message
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader
from holdfast_shared.agents import DEFAULT_AGENT, AgentDefinition, find_agent
from holdfast_shared.apikeys import KeyIdentity
from holdfast_shared.errors import ErrorCode

from holdfast_gateway.auth import RateLimited
from holdfast_gateway.errors import ApiError
from holdfast_gateway.limits import check_rate
from holdfast_gateway.state import GatewayState
from holdfast_gateway.tasks import TaskRef, find_task


async def get_state(request: Request) -> GatewayState:
    # async: a plain def would cost a threadpool hop on every request.
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


# Declared as the API's security scheme in /openapi.json; checked below.
engine_key = APIKeyHeader(
    name="X-Engine-Key",
    scheme_name="EngineKey",
    description="An API key (`holdfast keys create`); it names the tenant.",
    auto_error=False,
)


async def get_caller(
    request: Request,
    state: StateDep,
    x_engine_key: Annotated[str | None, Security(engine_key)] = None,
) -> KeyIdentity:
    """The key of the request (``X-Engine-Key``) and its tenant; 401 without a valid one."""
    if not x_engine_key:
        raise ApiError(401, ErrorCode.INVALID_KEY, "missing X-Engine-Key header")
    return await authenticate(request, state, x_engine_key)


async def authenticate(request: Request, state: GatewayState, key: str) -> KeyIdentity:
    """``key``'s id and tenant; 401 for an unknown or revoked key, 429 when
    the client's address failed too many checks."""
    address = request.client.host if request.client else ""
    try:
        identity = await state.auth.identify(key, address)
    except RateLimited as exc:
        raise ApiError(
            429,
            ErrorCode.RATE_LIMITED,
            f"too many failed API-key checks from this address; retry in {exc.retry_after} s",
            headers={"Retry-After": str(exc.retry_after)},
        ) from None
    if identity is None:
        raise ApiError(401, ErrorCode.INVALID_KEY, "the X-Engine-Key is not a valid API key")
    return identity


CallerDep = Annotated[KeyIdentity, Depends(get_caller)]


async def get_tenant(caller: CallerDep, state: StateDep) -> str:
    # Every authenticated request counts against its tenant's rate (429 over it).
    await check_rate(state.redis, state.keys, state.settings, caller.tenant)
    return caller.tenant


TenantDep = Annotated[str, Depends(get_tenant)]


async def require_json(request: Request) -> None:
    """415 unless the body is sent as JSON (``application/json`` or ``application/*+json``)."""
    value = request.headers.get("content-type")
    if value:
        parsed = email.message.Message()
        parsed["content-type"] = value
        subtype = parsed.get_content_subtype()
        if parsed.get_content_maintype() == "application" and (
            subtype == "json" or subtype.endswith("+json")
        ):
            return
    raise ApiError(
        415,
        ErrorCode.UNSUPPORTED_MEDIA_TYPE,
        "the body must be sent as application/json, not "
        + (repr(value[:100]) if value else "without a content type"),
    )


JsonBody = Depends(require_json)


async def require_task(state: GatewayState, tenant: str, name: str) -> TaskRef:
    """The tenant's task called ``name``, else 404 — also when only another
    tenant has a task of that name, which is neither seen nor touched."""
    async with state.sessions() as session:
        task = await find_task(session, tenant, name)
    if task is None:
        raise ApiError(404, ErrorCode.TASK_NOT_FOUND, f"task {name!r} not found")
    return task


def agent_not_found(name: str) -> ApiError:
    return ApiError(404, ErrorCode.AGENT_NOT_FOUND, f"agent {name!r} not found", {"agent": name})


async def require_agent(state: GatewayState, tenant: str, name: str | None) -> AgentDefinition:
    """The agent ``name`` (``general`` for None) as the tenant sees it, else 404
    ``AGENT_NOT_FOUND`` — also for another tenant's agent."""
    async with state.sessions() as session:
        agent = await find_agent(session, tenant, name or DEFAULT_AGENT)
    if agent is None:
        raise agent_not_found(name or DEFAULT_AGENT)
    return agent
