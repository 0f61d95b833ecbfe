"""Cancelling a task's turn from anywhere: the gateway (``POST /execute/cancel``,
an ``interrupt``, ``DELETE /v1/execution``, a schedule's ``cancel_previous``)
and a loop-worker (a parent turn that ends stops its subagents' turns).

Wherever the turn is, one of the signals reaches it: the flag covers a turn
between workers (checked when one takes it), the message stops a running one
at once, the job wakes a parked one. A paused turn is no worker's and no job
claims it, so it is made claimable first: the worker that takes the job finds
the flag and ends it as cancelled, with its events, as any other.
"""

from __future__ import annotations

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_shared.executions import store
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import Keys
from holdfast_shared.turnqueue import queue_turn

# The flag outlives any wait for a worker to take the turn.
_FLAG_TTL_SECONDS = 3600


async def request_cancel(
    redis: Redis,
    keys: Keys,
    sessions: async_sessionmaker[AsyncSession],
    tenant_id: str,
    task_id: str,
    turn_id: str,
) -> None:
    await redis.set(keys.cancel(task_id), turn_id, ex=_FLAG_TTL_SECONDS)
    await redis.publish(keys.cancels, f"{task_id} {turn_id}")
    async with sessions.begin() as session:
        await store.claimable_again(session, turn_id)
    await queue_turn(redis, keys, TurnJob.resuming(tenant_id, task_id, turn_id))
