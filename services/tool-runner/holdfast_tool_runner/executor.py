"""Run each attempt of a tool call at most once, and answer the loop-worker waiting for it.

The ``tool_results`` row is claimed (``running``) before the tool starts and
completed after, in PostgreSQL. A redelivered call finds the row: a finished
call's stored outcome is sent again; a call another runner is still running
is waited for; a call whose runner died mid-run (its ``runner_alive`` key
lapsed, or it overran its timeout) is marked ``unknown`` and answered so —
never run again here, because its side effects may already have happened.
Whether it runs again is the loop's to say (``holdfast_loop_worker.toolcalls``:
a read-only or idempotent call, or a person's ``retry``): it sends the call
with the next ``attempt``, which alone may claim an ``unknown`` row, once.
Every attempt carries the call's idempotency key (``HOLDFAST_IDEMPOTENCY_KEY``
in a sandboxed tool's environment, the ``_meta`` of an MCP call).
A call of an Asset Directory server's tool (``job.server``) is claimed and
answered the same way; it runs through ``connectors/`` instead of ``builtin.py``,
its server's progress reports relayed to ``job.reply_to`` as it runs
(``connectors/progress.py``).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

from holdfast_shared.db.models import ToolResultRecord
from holdfast_shared.jobs import InboxMessage, ToolCallJob, ToolOutcome
from holdfast_shared.keys import Keys
from holdfast_shared.observability.scopes import observed_tool_call, timed_tool_run
from redis.asyncio import Redis
from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_tool_runner.builtin import run_tool
from holdfast_tool_runner.checkpoints import WorkspaceCheckpoints
from holdfast_tool_runner.connectors import Connectors
from holdfast_tool_runner.connectors.elicitation import ElicitationRelay
from holdfast_tool_runner.connectors.progress import ProgressRelay
from holdfast_tool_runner.connectors.sampling import SamplingRelay
from holdfast_tool_runner.sandbox import Launchers, SandboxUnavailable
from holdfast_tool_runner.skillfiles import SkillFiles, release_skills_dir, skills_dir_problem
from holdfast_tool_runner.workspace_files import outputs_state, outputs_written
from holdfast_tool_runner.workspaces import WorkspaceError, Workspaces

log = logging.getLogger(__name__)

# How long past its own timeout a call claimed by another runner may run
# before we call its outcome unknown.
_GRACE = timedelta(seconds=30)


class ToolExecutor:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        sessions: async_sessionmaker[AsyncSession],
        workspaces: Workspaces,
        runner_id: str,
        launchers: Launchers | None = None,
        skill_files: SkillFiles | None = None,
        connectors: Connectors | None = None,
        archiving: WorkspaceCheckpoints | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        # Every write here is one statement, atomic alone: autocommit sessions
        # will do (holdfast_shared.db.autocommit_session_factory).
        self.sessions = sessions
        self.workspaces = workspaces
        self.runner_id = runner_id
        self.launchers = launchers
        # Where the skills a call names are written out for its sandbox.
        self.skill_files = skill_files
        # The tenants' MCP servers (None: this runner calls none).
        self.connectors = connectors
        # Restores a workspace this disk lacks before its call (None: no archives).
        self.archiving = archiving

    @observed_tool_call
    async def handle(self, job: ToolCallJob) -> ToolOutcome:
        """Run (or recall) the call and send the outcome to ``job.reply_to``."""
        outcome = await self._outcome(job)
        message = InboxMessage(
            kind="tool_result",
            correlation_id=f"{job.task_id}:{job.tool_call_id}",
            payload=outcome.model_dump(),
        )
        await self.redis.xadd(job.reply_to, message.to_fields(), maxlen=10_000)
        return outcome

    async def _outcome(self, job: ToolCallJob) -> ToolOutcome:
        if await self._claim(job):
            outcome = await self._run(job)
            await self._complete(job, outcome)
            if outcome.unknown is None:
                return outcome
            # As stored: this attempt's number, when it was sent and lost.
        return await self._recall(job)

    @timed_tool_run
    async def _run(self, job: ToolCallJob) -> ToolOutcome:
        if job.server is not None:
            if self.connectors is None:
                return ToolOutcome(error="MCP servers are not available on this tool-runner")
            return await self.connectors.call(
                job,
                ProgressRelay(self.redis, job),
                ElicitationRelay(self.redis, job),
                SamplingRelay(self.redis, job),
            )
        try:
            if self.archiving is not None:
                async with self.archiving.in_use(job.tenant_id, job.task_id) as restored:
                    return await self._run_in(job, restored)
            workspace: Path = await asyncio.to_thread(
                self.workspaces.ensure, job.tenant_id, job.task_id
            )
        except WorkspaceError as exc:
            # Fail closed as well: no workspace, or not one within its limits.
            return ToolOutcome(error=f"workspace unavailable, the tool did not run: {exc}")
        return await self._run_in(job, workspace)

    async def _run_in(self, job: ToolCallJob, workspace: Path) -> ToolOutcome:
        mounts: tuple[tuple[Path, str], ...] = ()
        if job.skills and self.skill_files is not None:
            problem = await asyncio.to_thread(skills_dir_problem, workspace)
            if problem is not None:
                return ToolOutcome(error=problem)
            try:
                mounts = await self.skill_files.mounts(job.tenant_id, job.skills)
            except OSError as exc:
                return ToolOutcome(error=f"skills unavailable, the tool did not run: {exc}")
        outputs = await asyncio.to_thread(outputs_state, workspace)
        try:
            outcome = await run_tool(
                job.tool,
                job.input,
                workspace,
                network=job.network,
                timeout_seconds=job.timeout_seconds,
                launchers=self.launchers,
                skill_mounts=mounts,
                idempotency_key=job.idempotency_key,
            )
            published = await asyncio.to_thread(outputs_written, workspace, outputs)
            return outcome.model_copy(update={"artifacts": published}) if published else outcome
        except SandboxUnavailable as exc:
            # Fail closed: the tool did not run, and the model is told why.
            return ToolOutcome(error=f"sandbox unavailable, the tool did not run: {exc}")
        finally:
            if mounts:
                await asyncio.to_thread(release_skills_dir, workspace)

    async def _claim(self, job: ToolCallJob) -> bool:
        """Take the call's attempt: a new row, or a row whose last attempt's
        outcome is unknown and older than this one (each attempt runs once)."""
        statement = insert(ToolResultRecord).values(
            task_id=job.task_id,
            tool_call_id=job.tool_call_id,
            turn_id=job.turn_id,
            tool=job.tool,
            input=job.input,
            status="running",
            runner=self.runner_id,
            attempt=job.attempt,
        )
        excluded = statement.excluded
        async with self.sessions.begin() as session:
            claimed = await session.scalar(
                statement.on_conflict_do_update(
                    index_elements=[ToolResultRecord.task_id, ToolResultRecord.tool_call_id],
                    set_={
                        "status": "running",
                        "runner": excluded.runner,
                        "attempt": excluded.attempt,
                        "started_at": datetime.now(UTC),
                        "output": None,
                        "error": None,
                        "finished_at": None,
                    },
                    where=(ToolResultRecord.status == "unknown")
                    & (ToolResultRecord.attempt < excluded.attempt),
                ).returning(ToolResultRecord.tool_call_id)
            )
        return claimed is not None

    async def _complete(self, job: ToolCallJob, outcome: ToolOutcome) -> None:
        unknown = outcome.unknown
        async with self.sessions.begin() as session:
            await session.execute(
                update(ToolResultRecord)
                .where(
                    ToolResultRecord.task_id == job.task_id,
                    ToolResultRecord.tool_call_id == job.tool_call_id,
                    ToolResultRecord.attempt == job.attempt,
                )
                .values(
                    status="done" if unknown is None else "unknown",
                    # JSONB column: wrap so any JSON value (even null) round-trips.
                    output={"value": outcome.output},
                    error=outcome.error if unknown is None else unknown.reason,
                    finished_at=datetime.now(UTC),
                )
            )

    async def _lost(self, row: ToolResultRecord, reason: str) -> None:
        """Mark the row's attempt ``unknown`` unless it finished meanwhile."""
        async with self.sessions.begin() as session:
            await session.execute(
                update(ToolResultRecord)
                .where(
                    ToolResultRecord.task_id == row.task_id,
                    ToolResultRecord.tool_call_id == row.tool_call_id,
                    ToolResultRecord.status == "running",
                    ToolResultRecord.attempt == row.attempt,
                    ToolResultRecord.runner == row.runner,
                )
                .values(status="unknown", error=reason, finished_at=datetime.now(UTC))
            )

    async def _recall(self, job: ToolCallJob) -> ToolOutcome:
        deadline = None
        while True:
            async with self.sessions() as session:
                row = await session.scalar(
                    select(ToolResultRecord).where(
                        ToolResultRecord.task_id == job.task_id,
                        ToolResultRecord.tool_call_id == job.tool_call_id,
                    )
                )
            assert row is not None
            if row.status != "running":
                return ToolOutcome.from_record(row)
            if deadline is None:
                deadline = row.started_at + timedelta(seconds=job.timeout_seconds) + _GRACE
            runner_gone = row.runner is not None and not await self.redis.exists(
                self.keys.runner_alive(row.runner)
            )
            if runner_gone or datetime.now(UTC) > deadline:
                log.warning(
                    "tool call %s (attempt %d) was lost on %s: outcome unknown",
                    job.tool_call_id,
                    row.attempt,
                    row.runner,
                )
                await self._lost(
                    row,
                    "its runner stopped mid-call" if runner_gone else "it overran its timeout",
                )
                continue  # read back what won: unknown, or a result stored just now
            await asyncio.sleep(0.5)
