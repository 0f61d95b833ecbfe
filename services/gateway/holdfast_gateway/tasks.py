"""How a task is named: the engine's id and the client's name for it.

A client names its task (``task_id`` on the API and in every event); the
name is unique within the client's tenant only. The engine keys everything
of the task — rows, Redis keys, its workspace — by ``Task.id``, minted when
the task is created and never reused. So two tenants may use the same name
without either reaching the other's task, and a name freed by a delete is
taken by a new task that shares nothing with the old one.
"""

from __future__ import annotations

from dataclasses import dataclass

from holdfast_shared.db.models import Task
from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncSession


@dataclass(frozen=True, slots=True)
class TaskRef:
    """A task as the engine keys it (``id``) and as its client names it (``name``)."""

    id: str
    name: str


async def find_task(session: AsyncSession, tenant_id: str, name: str) -> TaskRef | None:
    """The tenant's task called ``name``; None when it has none (another
    tenant's task of that name is invisible)."""
    task_id = await session.scalar(
        select(Task.id).where(Task.tenant_id == tenant_id, Task.name == name)
    )
    return None if task_id is None else TaskRef(task_id, name)


async def lock_task(
    session: AsyncSession, tenant_id: str, name: str, *, deleting: bool = False
) -> TaskRef | None:
    """:func:`find_task`, holding the task's row until the transaction ends.

    Whoever deletes the task (``deleting``) or adds a turn to it takes this
    lock first, so the two never interleave: a turn is never written for a
    task being deleted, and a delete never takes away a turn it did not see.
    None when the tenant has no such task (or it was deleted while we waited).

    Adding a turn takes ``FOR NO KEY UPDATE``: it excludes a delete (and
    another turn's start) but not the rows other transactions insert that
    reference the task (a running turn's messages)."""
    task_id = await session.scalar(
        select(Task.id)
        .where(Task.tenant_id == tenant_id, Task.name == name)
        .with_for_update(key_share=not deleting)
    )
    return None if task_id is None else TaskRef(task_id, name)


async def task_name(session: AsyncSession, task_id: str) -> str | None:
    """The client's name for the engine's task ``task_id``; None once it is deleted."""
    return await session.scalar(select(Task.name).where(Task.id == task_id))


def with_subagents(task_id: str) -> Select[tuple[str]]:
    """The ids of the task and of its subagents' tasks (``delegate``), at any depth."""
    family = select(Task.id).where(Task.id == task_id).cte("family", recursive=True)
    family = family.union_all(select(Task.id).where(Task.parent_task_id == family.c.id))
    return select(family.c.id)
