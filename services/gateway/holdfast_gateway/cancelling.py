"""Cancelling a task's turn, as ``POST /execute/cancel``, an ``interrupt`` and
``DELETE /v1/execution`` do: the signals are ``holdfast_shared.cancels``'s."""

from __future__ import annotations

from holdfast_shared import cancels

from holdfast_gateway.state import GatewayState


async def request_cancel(state: GatewayState, tenant_id: str, task_id: str, turn_id: str) -> None:
    await cancels.request_cancel(
        state.redis, state.keys, state.sessions, tenant_id, task_id, turn_id
    )
