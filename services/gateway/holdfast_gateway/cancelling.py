"""Cancelling a task's turn, as ``POST /execute/cancel``, an ``interrupt`` and
``DELETE /v1/execution`` do.

Wherever the turn is, one of the signals reaches it: the flag covers a turn
between workers (checked when one takes it), the message stops a running one
at once, the job wakes a parked one. A paused turn is no worker's and no job
claims it, so it is made claimable first: the worker that takes the job finds
the flag and ends it as cancelled, with its events, as any other.
"""

from __future__ import annotations

from holdfast_shared.executions import store
from holdfast_shared.jobs import TurnJob
from holdfast_shared.turnqueue import queue_turn

from holdfast_gateway.state import GatewayState


async def request_cancel(state: GatewayState, tenant_id: str, task_id: str, turn_id: str) -> None:
    keys = state.keys
    await state.redis.set(keys.cancel(task_id), turn_id, ex=3600)
    await state.redis.publish(keys.cancels, f"{task_id} {turn_id}")
    async with state.sessions.begin() as session:
        await store.claimable_again(session, turn_id)
    await queue_turn(state.redis, keys, TurnJob.resuming(tenant_id, task_id, turn_id))
