"""A paused execution's subagents pause with it, and resume with it.

The child tasks a ``delegate`` call started (``tasks.with_subagents``, at any
depth) are no executions of their own. ``POST /v1/execution/{id}/pause`` sets
the pause request (``Keys.pause``) of each of their turns still under way and
publishes it, as for the execution's own turn: each parks at its next step
boundary, or at once when it is streaming a model call or waiting for its own
subagents. ``.../resume`` withdraws each request under the child task's row
lock, which a parking worker takes too (``executions.store.lock_for_pause``),
so a child either parked before the resume, and is queued again, or finds
its request gone and goes on.
"""

from __future__ import annotations

from holdfast_shared.db.models import Task, Turn
from holdfast_shared.executions import store
from holdfast_shared.jobs import TurnJob
from holdfast_shared.turnqueue import ACTIVE, queue_turn
from sqlalchemy import select

from holdfast_gateway.state import GatewayState
from holdfast_gateway.tasks import with_subagents


async def request_pause(state: GatewayState, task_id: str, turn_id: str) -> None:
    """Ask the turn to park paused at its next step boundary (a model call it
    is streaming is cut short by the message)."""
    # Kept as long as a paused turn may wait; a resume or the turn's end clears it.
    ttl = state.settings.channel_state_ttl_hitl + 3600
    await state.redis.set(state.keys.pause(task_id), turn_id, ex=ttl)
    await state.redis.publish(state.keys.pauses, f"{task_id} {turn_id}")


async def pause(state: GatewayState, task_id: str) -> int:
    """Ask the turns of ``task_id``'s subagents still under way to pause; how many."""
    turns = await _subagent_turns(state, task_id, ACTIVE)
    for child_task, child_turn in turns:
        await request_pause(state, child_task, child_turn)
    return len(turns)


async def resume(state: GatewayState, tenant_id: str, task_id: str) -> int:
    """Withdraw the pause of ``task_id``'s subagents and queue those that parked; how many."""
    turns = await _subagent_turns(state, task_id, (*ACTIVE, "paused"))
    queued = 0
    for child_task, child_turn in turns:
        async with state.sessions.begin() as session:
            await session.execute(
                select(Task.id).where(Task.id == child_task).with_for_update(key_share=True)
            )
            await state.redis.delete(state.keys.pause(child_task))
            parked = await store.claimable_again(session, child_turn)
        if parked:
            await queue_turn(
                state.redis, state.keys, TurnJob.resuming(tenant_id, child_task, child_turn)
            )
            queued += 1
    return queued


async def _subagent_turns(
    state: GatewayState, task_id: str, statuses: tuple[str, ...]
) -> list[tuple[str, str]]:
    async with state.sessions() as session:
        rows = await session.execute(
            select(Turn.task_id, Turn.id).where(
                Turn.task_id.in_(with_subagents(task_id)),
                Turn.task_id != task_id,
                Turn.status.in_(statuses),
            )
        )
    return [(child_task, child_turn) for child_task, child_turn in rows]
