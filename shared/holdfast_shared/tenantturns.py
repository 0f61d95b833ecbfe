"""A tenant's turn counts against ``HOLDFAST_TENANT_MAX_RUNNING_TURNS`` and
``HOLDFAST_TENANT_MAX_QUEUED_TURNS``, checked by whoever writes a turn: the
gateway for a client's message (a 429, ``holdfast_gateway.limits``) and the
loop-worker for a subagent's (the ``delegate`` call's error).

The counts are read from PostgreSQL's ``turns.status`` — the record every
ending path (completed, errored, cancelled, parked, a worker's crash and
takeover) already keeps — so nothing can leak a slot; a per-tenant advisory
lock, held by the transaction that writes the turn, keeps concurrent writers
from overshooting. Take it after the task's row lock, as every writer does.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.db.models import Task, Turn
from holdfast_shared.turnqueue import PENDING


@dataclass(frozen=True, slots=True)
class TurnLimit:
    statuses: tuple[str, ...]
    setting: str
    # What the counted turns are doing, and when to retry (for the message).
    doing: str
    retry_when: str


# A turn ``queued`` for a worker counts as running: it starts as soon as one is free.
RUNNING = TurnLimit(
    ("queued", "running"), "HOLDFAST_TENANT_MAX_RUNNING_TURNS", "running", "one ended"
)
# Messages waiting for their task's running turn (the ``turnqueue`` statuses).
WAITING = TurnLimit(PENDING, "HOLDFAST_TENANT_MAX_QUEUED_TURNS", "waiting to run", "they started")


class AtTurnLimit(Exception):
    """The tenant has ``most`` turns in the limit's statuses or more."""

    def __init__(self, tenant_id: str, limit: TurnLimit, found: int, most: int) -> None:
        super().__init__(
            f"tenant {tenant_id!r} has {found} turns {limit.doing} "
            f"({limit.setting}={most}); retry once {limit.retry_when}"
        )
        self.limit = limit
        self.most = most


async def check_turns(session: AsyncSession, tenant_id: str, limit: TurnLimit, most: int) -> None:
    """Before a turn is written in ``session``'s transaction: :class:`AtTurnLimit`
    when the tenant has ``most`` turns in ``limit``'s statuses (0: no limit). The
    tenant's lock is held until the transaction ends."""
    if most <= 0:
        return
    await session.execute(
        select(func.pg_advisory_xact_lock(func.hashtext(f"holdfast:tenant-turns:{tenant_id}")))
    )
    found = await session.scalar(
        select(func.count())
        .select_from(Turn)
        .join(Task, Task.id == Turn.task_id)
        .where(Task.tenant_id == tenant_id, Turn.status.in_(limit.statuses))
    )
    if int(found or 0) >= most:
        raise AtTurnLimit(tenant_id, limit, int(found or 0), most)
