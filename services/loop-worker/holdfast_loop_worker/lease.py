"""Turn leases: which worker runs a turn, kept in PostgreSQL.

A worker claims a turn before running it (a conditional update: the turn is
unowned, or its lease ran out, or it is already ours) and renews the leases
of all its turns every third of ``HOLDFAST_LEASE_SECONDS``. A worker that
dies stops renewing; once its lease runs out another worker's claim
succeeds. The claim is the mutual exclusion — Redis only delivers the job
(and may deliver it twice) — and, being in PostgreSQL, it survives a Redis
that lost its data.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from holdfast_shared.db.models import Turn
from sqlalchemy import or_, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

ACTIVE = ("queued", "running", "parked")
# Past a lapsed lease's end before claiming: clocks of the workers' hosts differ a bit.
_LAPSE_MARGIN_SECONDS = 0.05


class Leases:
    """Every change here is one UPDATE: ``sessions`` may be autocommit ones
    (holdfast_shared.db.autocommit_session_factory), a round trip each."""

    def __init__(
        self, sessions: async_sessionmaker[AsyncSession], owner: str, *, lease_seconds: int
    ) -> None:
        self.sessions = sessions
        self.owner = owner
        self.duration = timedelta(seconds=lease_seconds)

    async def claim(self, turn_id: str) -> bool:
        """Take the turn if nobody holds it; False if it is held or already over."""
        now = datetime.now(UTC)
        async with self.sessions.begin() as session:
            claimed = await session.scalar(
                update(Turn)
                .where(
                    Turn.id == turn_id,
                    Turn.status.in_(ACTIVE),
                    or_(
                        Turn.lease_until.is_(None),
                        Turn.lease_until < now,
                        Turn.lease_owner == self.owner,
                    ),
                )
                .values(status="running", lease_owner=self.owner, lease_until=now + self.duration)
                .returning(Turn.id)
            )
        return claimed is not None

    async def claim_after_lapse(self, turn_id: str, lease_until: datetime | None) -> bool:
        """Claim a turn whose holder stopped renewing just before its lease ran out.

        The turns stream offers a job to another worker once it has been idle for a
        lease, counted from its delivery; the lease runs from the holder's claim, a
        moment later. So a holder that died before its first renewal leaves its job
        offered a little before the lease ends: wait for that end, rather than leave
        the job for a whole lease more. Never longer than a third of a lease, which a
        live holder's renewals always keep ahead of it: that holder is left alone.
        """
        if lease_until is None:
            return False
        wait = (lease_until - datetime.now(UTC)).total_seconds()
        if wait > self.duration.total_seconds() / 3:
            return False
        await asyncio.sleep(max(0.0, wait) + _LAPSE_MARGIN_SECONDS)
        return await self.claim(turn_id)

    async def renew(self, turn_ids: Iterable[str]) -> None:
        ids = list(turn_ids)
        if not ids:
            return
        async with self.sessions.begin() as session:
            await session.execute(
                update(Turn)
                .where(Turn.id.in_(ids), Turn.lease_owner == self.owner)
                .values(lease_until=datetime.now(UTC) + self.duration)
            )

    async def revoke(self, owner: str, turn_ids: Iterable[str]) -> None:
        """End the leases ``owner`` holds on these turns: it was found dead (its liveness
        key lapsed), so they are free to claim now rather than when they run out.

        Should ``owner`` only have been paused, it finds its appends fenced by the new
        holder's epoch, and its renewals no longer match.
        """
        ids = list(turn_ids)
        if not ids or owner == self.owner:
            return
        async with self.sessions.begin() as session:
            await session.execute(
                update(Turn)
                .where(Turn.id.in_(ids), Turn.lease_owner == owner, Turn.status.in_(ACTIVE))
                .values(lease_owner=None, lease_until=None)
            )

    async def release(self, turn_id: str, *, status: str | None = None) -> None:
        """Give the turn up (to be resumed at once by whoever gets its next job)."""
        async with self.sessions.begin() as session:
            await self.release_in(session, turn_id, status=status)

    async def release_in(
        self, session: AsyncSession, turn_id: str, *, status: str | None = None
    ) -> bool:
        """:meth:`release` within ``session``'s transaction (with what else it commits);
        False when this worker no longer held the turn (its lease lapsed and another
        worker took it)."""
        values: dict[str, object] = {"lease_owner": None, "lease_until": None}
        if status is not None:
            values["status"] = status
        released = await session.scalar(
            update(Turn)
            .where(Turn.id == turn_id, Turn.lease_owner == self.owner)
            .values(**values)
            .returning(Turn.id)
        )
        return released is not None

    async def hold_in(self, session: AsyncSession, turn_id: str, *, seconds: float) -> None:
        """The turn running again and ours for ``seconds`` plus a lease, whatever
        its row said (an ended turn an execution retries): should this worker
        die meanwhile, the lease lapses and whoever takes the job over goes on."""
        await session.execute(
            update(Turn)
            .where(Turn.id == turn_id)
            .values(
                status="running",
                stop_reason=None,
                finished_at=None,
                lease_owner=self.owner,
                lease_until=datetime.now(UTC) + timedelta(seconds=seconds) + self.duration,
            )
        )
