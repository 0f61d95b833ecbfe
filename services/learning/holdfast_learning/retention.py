"""Retention: deleting rows whose time is up."""

from __future__ import annotations

from holdfast_shared.db import ChannelStateSnapshot
from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

# Deleting in batches keeps each transaction (and its locks) short even when
# a large backlog has expired at once.
BATCH = 5000


async def delete_expired_snapshots(
    sessions: async_sessionmaker[AsyncSession], *, batch: int = BATCH
) -> int:
    """Delete every channel state snapshot with ``expires_at`` in the past; return how many.

    Each batch commits on its own, so an interrupted run keeps what it did.
    """
    deleted = 0
    while True:
        async with sessions() as session, session.begin():
            expired = (
                select(ChannelStateSnapshot.id)
                .where(ChannelStateSnapshot.expires_at < func.now())
                .limit(batch)
            )
            result = await session.execute(
                delete(ChannelStateSnapshot).where(ChannelStateSnapshot.id.in_(expired))
            )
        count = result.rowcount or 0  # type: ignore[attr-defined]
        deleted += count
        if count < batch:
            return deleted
