"""The sweep: trajectories the intake did not learn, learned anyway.

Two kinds are due: a failed one whose backoff has passed (its retry), and
one still pending well after it finished — its announcement was lost (the
loop-worker died between committing the trajectory and announcing it, or
the stream was trimmed under a backlog). Runs as an arq cron job, so with
several learning processes each sweep runs once.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from holdfast_shared.db.models import TrajectoryRecord
from sqlalchemy import and_, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_learning.learner import BatchResult, Learner

# A trajectory pending this long after it finished was not announced (the
# intake takes well under a second when it keeps up).
LOST_AFTER = timedelta(minutes=2)
_BATCH = 200


async def due_trajectories(
    sessions: async_sessionmaker[AsyncSession], now: datetime, *, limit: int = _BATCH
) -> list[str]:
    async with sessions() as session:
        rows = await session.execute(
            select(TrajectoryRecord.id)
            .where(
                TrajectoryRecord.status == "pending",
                or_(
                    and_(
                        TrajectoryRecord.attempts == 0,
                        TrajectoryRecord.finished_at < now - LOST_AFTER,
                    ),
                    and_(
                        TrajectoryRecord.attempts > 0,
                        TrajectoryRecord.next_attempt_at <= now,
                    ),
                ),
            )
            .order_by(TrajectoryRecord.finished_at)
            .limit(limit)
        )
        return list(rows.scalars())


async def sweep(
    sessions: async_sessionmaker[AsyncSession], learner: Learner, now: datetime
) -> BatchResult:
    # Due by the sweep's clock (which tests move), not the learner's.
    return await learner.learn(await due_trajectories(sessions, now), due_only=False)
