"""Conversation branches: which of a task's messages the next turn sees.

A task's conversation is its ``messages`` in id order. Editing an earlier
message, answering one again, or rolling an execution back to a checkpoint
does not delete anything: it *forks* the conversation. The messages after
the fork point leave the current branch — their ``taken_off_by`` names the
fork (a ``conversation_forks`` row) — and new messages continue the current
branch from there. Messages whose ``taken_off_by`` is NULL are the current
branch; the others stay readable (``GET /tasks/{task_id}/messages?branch=all``),
grouped by the fork that took them off.

A fork always takes off a *suffix* of the current branch (every current
message after a point). So a message that is still current proves that every
message before it which was current at that time still is — which is what
makes a compaction summary usable (:func:`summary_still_current`): a summary
covers the current messages up to its ``last_message_id`` as they were when
it was made, and stays valid exactly as long as that message is current.

Every reader of the conversation for the model goes through
:data:`ON_CURRENT_BRANCH` (``conversation.load_history``) and
:func:`summary_still_current` (the context engine's summaries).
"""

from __future__ import annotations

from typing import Literal, get_args

from sqlalchemy import ColumnElement, exists, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.db.models import ContextSummary, ConversationFork, Message, Task
from holdfast_shared.ids import new_id

ForkReason = Literal["edit", "retry", "rollback"]
FORK_REASONS: frozenset[str] = frozenset(get_args(ForkReason))

# A message on the current branch (a condition on ``messages`` rows).
ON_CURRENT_BRANCH: ColumnElement[bool] = Message.taken_off_by.is_(None)


async def take_off_after(
    session: AsyncSession, task_id: str, last_kept_message_id: int | None, *, reason: str
) -> str:
    """Fork the task's conversation after ``last_kept_message_id``.

    Every message of the task on the current branch with a greater id (every
    one, when None) leaves the branch; the fork is recorded with ``reason``
    (``edit`` | ``retry`` | ``rollback``) and its id returned. Runs in the
    caller's transaction: the fork and what follows it (the new turn's
    message) commit together or not at all. Forks of one task are serialised
    (the task's row is locked until the transaction ends).

    The caller makes sure no turn of the task is writing messages meanwhile
    (the task's turn lock): a message stored after the fork by a turn that
    was running would land on the new branch.

    Raises ``ValueError`` for an unknown reason or task.
    """
    if reason not in FORK_REASONS:
        raise ValueError(f"a fork's reason is one of {sorted(FORK_REASONS)}, not {reason!r}")
    locked = await session.scalar(select(Task.id).where(Task.id == task_id).with_for_update())
    if locked is None:
        raise ValueError(f"no task {task_id!r}")
    fork_id = new_id("fork")
    await session.execute(
        insert(ConversationFork).values(
            id=fork_id, task_id=task_id, reason=reason, after_message_id=last_kept_message_id
        )
    )
    taken = update(Message).where(Message.task_id == task_id, ON_CURRENT_BRANCH)
    if last_kept_message_id is not None:
        taken = taken.where(Message.id > last_kept_message_id)
    await session.execute(taken.values(taken_off_by=fork_id))
    return fork_id


def summary_still_current() -> ColumnElement[bool]:
    """A condition on ``context_summaries`` rows: the summary covers only messages
    that are still on the current branch (its last message is; see the module
    docstring for why that is enough)."""
    return exists().where(
        Message.id == ContextSummary.last_message_id,
        Message.task_id == ContextSummary.task_id,
        ON_CURRENT_BRANCH,
    )
