"""Child tasks: starting a subagent's task, reading its log, stopping it.

A ``delegate`` call (``turn/delegation.py``) runs as a *child task*: a task
of the parent's tenant, named for the call (:func:`child_name`: the same
name on every run of the call, so a parent resumed on another worker finds
the child its first run started instead of starting a second), with the
brief as its first turn's message and the call's ``files`` copied from
the parent's workspace into its own before that turn is written. The
child's first turn is started the way ``turnqueue.start_next`` starts a
promoted one — rows in one transaction (the turn with ``lease_until`` now,
its message), then its ``started`` under a fresh epoch, then the job — so
a worker that dies after the commit leaves a turn the stale-turn sweep
announces and queues (``recovery._announce_promoted``), never one started
twice. A child's turn counts against ``HOLDFAST_TENANT_MAX_RUNNING_TURNS``
as a client's does (``holdfast_shared.tenantturns``). A copy that fails, or
a tenant at that limit, leaves the child task without a turn (deleted with
its parent, or carried on by a later run of the call); the call's result
says why.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from holdfast_shared import cancels, tenantturns
from holdfast_shared.conversation import user_content
from holdfast_shared.db.models import Message, Task, Turn
from holdfast_shared.errors import Superseded
from holdfast_shared.eventlog import EventLog, LoggedEvent, next_epoch
from holdfast_shared.eventlog.records import seq_of
from holdfast_shared.events import ThreadLifecycle, body_json
from holdfast_shared.ids import new_id, new_task_id
from holdfast_shared.jobs import TurnJob, WorkspaceFiles, WorkspaceFilesReply
from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import BLOCK_SLICE_SECONDS
from holdfast_shared.turnlock import TurnLock
from holdfast_shared.turnqueue import ACTIVE, queue_turn
from holdfast_shared.workspace_checkpoints.requests import ask_runner
from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

# Events a read of a child's log hands on at most.
_PAGE = 1000
# How long a tool-runner may take to copy one of a delegate call's ``files``
# (the parent's workspace may be restored from its archive first).
_COPY_TIMEOUT_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Parent:
    """The delegating turn, as its child needs it."""

    tenant_id: str
    task_id: str
    turn_id: str
    user_id: str
    model: str | None
    depth: int


@dataclass(frozen=True, slots=True)
class Child:
    task_id: str
    name: str
    turn_id: str
    agent: str
    depth: int


@dataclass(frozen=True, slots=True)
class ChildEnd:
    status: str
    stop_reason: str | None
    answer: str


class DepthExceeded(Exception):
    """Delegating would make a task deeper than ``HOLDFAST_MAX_SUBAGENT_DEPTH``."""


class NotAChild(Exception):
    """The call's child name is taken by a task that is not the call's child."""


class FilesNotCopied(Exception):
    """A path of the call's ``files`` could not be copied into the child's workspace."""


def child_name(parent: Parent, agent: str, tool_call_id: str) -> str:
    """The child task's name: the same for every run of the one call."""
    digest = hashlib.sha256(
        f"{parent.task_id}/{parent.turn_id}/{tool_call_id}".encode()
    ).hexdigest()
    return f"{agent}.{digest[:16]}"


@dataclass(frozen=True, slots=True)
class Subagents:
    """Child tasks over the worker's stores."""

    sessions: async_sessionmaker[AsyncSession]
    redis: Redis
    keys: Keys
    eventlog: EventLog
    lock: TurnLock
    # HOLDFAST_TENANT_MAX_RUNNING_TURNS: a child's turn counts as a client's does.
    max_running_turns: int = 0

    async def depth_of(self, task_id: str) -> int:
        async with self.sessions() as session:
            depth = await session.scalar(select(Task.depth).where(Task.id == task_id))
        return int(depth or 0)

    async def start(
        self,
        parent: Parent,
        agent: str,
        brief: str,
        tool_call_id: str,
        files: Sequence[str] = (),
    ) -> Child:
        """The call's child task with its first turn: started now, or found
        started by an earlier run of the call.

        The task's row comes first, then its ``files`` (copied from the parent's
        workspace by a tool-runner), then its turn: a run that died between
        them left a task with no turn, which the next run of the call finds
        and carries on with (the copy again, the same bytes)."""
        name = child_name(parent, agent, tool_call_id)
        task_id, found = await self._task(parent, name, agent)
        if found is not None:
            return found
        for path in files:
            await self._copy(parent, task_id, path)
        child = Child(task_id, name, new_id("turn"), agent, parent.depth + 1)
        written, epoch = await self._write_turn(parent, child, brief)
        if epoch is not None:
            await self._announce(parent, written, epoch)
        return written

    async def _write_turn(
        self, parent: Parent, child: Child, brief: str
    ) -> tuple[Child, int | None]:
        """The child's first turn and its message, written with the task's lock
        taken and a fresh epoch (to announce it under); or the turn an earlier
        run of the call wrote meanwhile, with no epoch."""
        task_id = child.task_id
        async with self.sessions.begin() as session:
            # Held until the turn is committed: two runs of the call (a stale
            # one and its takeover) write one turn.
            await session.execute(select(Task.id).where(Task.id == task_id).with_for_update())
            if (found := await _first_turn(session, task_id)) is not None:
                return Child(task_id, child.name, found, child.agent, child.depth), None
            await tenantturns.check_turns(
                session, parent.tenant_id, tenantturns.RUNNING, self.max_running_turns
            )
            # No turn of the task was ever committed: whatever holds its lock
            # is a run that died before its commit.
            holder = await self.lock.holder(task_id)
            if holder is None or holder == child.turn_id:
                await self.lock.acquire(task_id, child.turn_id)
            else:
                await self.lock.replace(task_id, holder, child.turn_id)
            epoch = await next_epoch(self.redis, self.keys, task_id)
            session.add(
                Turn(
                    id=child.turn_id,
                    task_id=task_id,
                    status="queued",
                    agent=child.agent,
                    model=parent.model,
                    user_id=parent.user_id,
                    # A start that dies before its job is queued is announced and
                    # queued by the stale-turn sweep, never removed as unaccepted.
                    lease_until=datetime.now(UTC),
                )
            )
            await session.flush()
            session.add(
                Message(
                    task_id=task_id,
                    turn_id=child.turn_id,
                    position=0,
                    role="user",
                    content=user_content(brief, []),
                )
            )
        return child, epoch

    async def _announce(self, parent: Parent, child: Child, epoch: int) -> None:
        """The turn's ``started``, then its job."""
        started = ThreadLifecycle(phase="started")
        try:
            await self.eventlog.append_bodies(
                child.task_id,
                child.turn_id,
                [(started.type, body_json(started))],
                name=child.name,
                new_task=True,
                epoch=epoch,
            )
        except Superseded:
            return  # stalled past the stale-turn sweep, which announced and queued it
        job = TurnJob(
            task_id=child.task_id,
            turn_id=child.turn_id,
            tenant_id=parent.tenant_id,
            agent=child.agent,
            model=parent.model,
        )
        await queue_turn(self.redis, self.keys, job)

    async def _task(self, parent: Parent, name: str, agent: str) -> tuple[str, Child | None]:
        """The child task's id, created now or found; with its turn if it has one."""
        async with self.sessions.begin() as session:
            created = await session.scalar(
                insert(Task)
                .values(
                    id=new_task_id(),
                    tenant_id=parent.tenant_id,
                    name=name,
                    agent=agent,
                    model=parent.model,
                    parent_task_id=parent.task_id,
                    depth=parent.depth + 1,
                )
                .on_conflict_do_nothing(constraint="uq_tasks_tenant_id_name")
                .returning(Task.id)
            )
            if created is not None:
                return created, None
            task = (
                await session.execute(
                    select(Task.id, Task.parent_task_id, Task.depth).where(
                        Task.tenant_id == parent.tenant_id, Task.name == name
                    )
                )
            ).one()
            if task.parent_task_id != parent.task_id:
                raise NotAChild(name)
            turn_id = await _first_turn(session, task.id)
        if turn_id is None:
            return task.id, None
        return task.id, Child(task.id, name, turn_id, agent, int(task.depth))

    async def _copy(self, parent: Parent, task_id: str, path: str) -> None:
        """Copy ``path`` of the parent's workspace into the child's (a tool-runner does)."""
        request_id = secrets.token_hex(16)
        request = WorkspaceFiles(
            request_id=request_id,
            tenant_id=parent.tenant_id,
            task_id=task_id,
            action="copy",
            path=path,
            from_task_id=parent.task_id,
            reply_to=self.keys.workspace_reply(request_id),
        )
        answer = await ask_runner(self.redis, self.keys, request, _COPY_TIMEOUT_SECONDS)
        if answer is None:
            waited = f"{_COPY_TIMEOUT_SECONDS:g} s"
            raise FilesNotCopied(f"no tool-runner copied {path!r} within {waited}")
        reply = WorkspaceFilesReply.model_validate_json(answer)
        if reply.error is not None:
            raise FilesNotCopied(f"{path!r} was not copied: {reply.error}")

    async def events(self, child: Child, after_seq: int) -> AsyncIterator[list[LoggedEvent]]:
        """The child's events after ``after_seq``, in pages, waiting for more
        when none are left (the caller stops reading at the child's end).

        What is stored already comes through the log's reader (PostgreSQL for
        what the Redis copy no longer holds); from there the Redis copy is
        followed with XREAD, whose answer is the next page. A page that does
        not follow on from the cursor (the copy trimmed meanwhile) sends the
        reader back to the stored log."""
        cursor = after_seq
        key = self.keys.events(child.task_id)
        while True:
            async for page in self.eventlog.pages_after(child.task_id, cursor):
                yield page
                cursor = page[-1].seq
            while True:
                answer = await self.redis.xread(
                    {key: f"{cursor}-0"}, count=_PAGE, block=int(BLOCK_SLICE_SECONDS * 1000)
                )
                entries = [entry for _key, found in answer or () for entry in found]
                if not entries:
                    continue
                page = [LoggedEvent(seq_of(eid), f["t"], f["d"]) for eid, f in entries]
                if page[0].seq != cursor + 1:
                    break  # a gap: read it from the stored log
                yield page
                cursor = page[-1].seq

    async def answer(self, child: Child) -> str:
        """The text of the child's last assistant message ("" when none): its
        final answer, stored before its turn's end is logged."""
        async with self.sessions() as session:
            content = await session.scalar(
                select(Message.content)
                .where(Message.turn_id == child.turn_id, Message.role == "assistant")
                .order_by(Message.id.desc())
                .limit(1)
            )
        blocks = (content or {}).get("blocks", ())
        return "".join(b.get("text", "") for b in blocks if b.get("type") == "text")

    async def stop_children(self, tenant_id: str, task_id: str) -> int:
        """Cancel the turns of ``task_id``'s children still under way or paused
        (its turn ended: nothing waits for them). Each child's own end stops its
        children."""
        async with self.sessions() as session:
            running = (
                await session.execute(
                    select(Turn.task_id, Turn.id)
                    .join(Task, Task.id == Turn.task_id)
                    .where(Task.parent_task_id == task_id, Turn.status.in_((*ACTIVE, "paused")))
                )
            ).all()
        for child_task, child_turn in running:
            await cancels.request_cancel(
                self.redis, self.keys, self.sessions, tenant_id, child_task, child_turn
            )
        return len(running)


async def _first_turn(session: AsyncSession, task_id: str) -> str | None:
    return await session.scalar(
        select(Turn.id).where(Turn.task_id == task_id).order_by(Turn.created_at).limit(1)
    )
