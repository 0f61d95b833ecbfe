"""FastAPI dependencies: the gateway state and the caller's tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from holdfast_shared.errors import ErrorCode

from holdfast_gateway.errors import ApiError
from holdfast_gateway.state import GatewayState


async def get_state(request: Request) -> GatewayState:
    # async: a plain def would cost a threadpool hop on every request.
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


async def get_tenant(
    state: StateDep,
    x_engine_key: Annotated[str | None, Header(alias="X-Engine-Key")] = None,
) -> str:
    if not x_engine_key:
        raise ApiError(401, ErrorCode.INVALID_KEY, "missing X-Engine-Key header")
    tenant = await state.auth.tenant(x_engine_key)
    if tenant is None:
        raise ApiError(401, ErrorCode.INVALID_KEY, "the X-Engine-Key is not a valid API key")
    return tenant


TenantDep = Annotated[str, Depends(get_tenant)]
