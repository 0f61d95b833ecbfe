"""What a run does before its first step: read the turn, take it up where its
last snapshot left it, and resolve who the model is (agent, tools, skills, model).

These fill in the engine's handle (:class:`LiveTurn`) for the conductor; the
steps then see only the :class:`TurnHandle`.
"""

from __future__ import annotations

from datetime import UTC, datetime

from holdfast_shared.agents import model_for, resolve_agent
from holdfast_shared.db.models import Turn
from holdfast_shared.observability import metrics
from holdfast_shared.providers import ModelChoice

from holdfast_loop_worker import executions
from holdfast_loop_worker.skills import TurnSkills
from holdfast_loop_worker.turn.live import LiveTurn
from holdfast_loop_worker.turn.rows import turn_to_run


async def load_turn(turn: LiveTurn) -> Turn | None:
    """The turn's row as it was before this worker claimed it; None when it is over
    (or its task was deleted)."""
    async with turn.ctx.reads() as session:
        found = await turn_to_run(session, turn.job.turn_id)
    if found is None:
        return None  # its task was deleted
    row = found.row
    turn.emitter.task_name = found.task_name
    turn.stored_memory, turn.stored_calibration = found.stored_memory, found.stored_calibration
    turn.subagent_of = found.parent_task_id
    if row.status not in ("queued", "running", "parked"):
        return None
    turn.agent = turn.job.agent or row.agent
    turn.model = turn.job.model or row.model
    turn.output_schema = row.output_schema
    return row


async def begin(turn: LiveTurn, row: Turn, resume_reason: str | None) -> bool:
    """Take up the turn where its last snapshot left it; whether there was one."""
    ctx, job = turn.ctx, turn.job
    turn.user_id, turn.queued_at = row.user_id, row.created_at
    turn.execution = await executions.ExecutionRun.load(ctx, job)
    snapshot = await ctx.snapshots.latest(job.turn_id)
    # A turn that never ran (its first job was lost) just starts.
    turn.resuming = snapshot is not None or (resume_reason is not None and row.status != "queued")
    if snapshot is not None:
        turn.state, turn.boundary = snapshot, snapshot.to_json()
    await ctx.lock.ensure(job.task_id, job.turn_id)
    await ctx.context.begin_turn(
        job.task_id,
        turn.state,
        resumed=snapshot is not None,
        stored=turn.stored_memory,
        calibration=turn.stored_calibration,
    )
    return snapshot is not None


def state_expired(turn: LiveTurn, row: Turn) -> bool:
    """No live snapshot of a turn older than the snapshots' TTL: its state is gone.

    (A young turn without one simply died before its first snapshot and
    starts over.)
    """
    age = datetime.now(UTC) - row.created_at
    return row.status != "queued" and age > turn.ctx.snapshots.active_ttl


def budget(turn: LiveTurn) -> float:
    """The run's time: what is left of the turn's deadline (active time, as
    snapshots count it), cut to what is left of its execution's."""
    left = max(0.0, turn.ctx.deadline_seconds - turn.state.active_ms / 1000)
    if turn.execution is not None:
        left = turn.execution.budget(left, turn.state.active_ms)
    return left


async def resolve(turn: LiveTurn) -> ModelChoice:
    """Who the model is in this turn: its agent, tools, skills and model.

    Read again by a worker that resumes the turn: the agent is named on the
    turn's row, and a custom one deleted since fails the turn here."""
    ctx, tenant_id = turn.ctx, turn.job.tenant_id
    agent = await resolve_agent(ctx.sessions, tenant_id, turn.agent)
    turn.definition = agent
    if ctx.tools is not None:
        turn.server_tools = await ctx.tools.server_tools(tenant_id, agent)
    turn.skills = await TurnSkills.load(ctx.sessions, tenant_id, agent, tools=ctx.tools is not None)
    requested = model_for(
        agent, requested=turn.model, overrides=ctx.agent_models, served=ctx.providers.names
    )
    turn.choice = choice = ctx.providers.resolve(requested)
    if not turn.resuming:
        metrics.turn_started(agent.name, f"{choice.provider.name}:{choice.model}")
    return choice
