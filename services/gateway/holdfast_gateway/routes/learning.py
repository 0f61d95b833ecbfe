"""``GET /learning/status``: how far the learning centre is behind, for the caller's tenant.

Counted from the ``trajectories`` table (``TrajectoryRecord``): a trajectory
is ``pending`` until learned (``done``), or ``dead`` after
``HOLDFAST_LEARNING_MAX_ATTEMPTS`` failures; ``attempts`` counts its failed
attempts. The lag is the age of the oldest pending one, on PostgreSQL's
clock. ``stream`` describes the Redis stream that announces trajectories to
the learners (``Keys.trajectories``, group ``LEARNING_GROUP``); it is shared
by every tenant, so it says how busy the learning centre is, not whose work
waits.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from holdfast_shared.db.models import TrajectoryRecord
from holdfast_shared.keys import LEARNING_GROUP
from holdfast_shared.streams import group_lag
from pydantic import BaseModel, Field
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from sqlalchemy import func, select

from holdfast_gateway import errors
from holdfast_gateway.deps import StateDep, TenantDep

router = APIRouter(tags=["learning"])


class StreamStatus(BaseModel):
    # Entries in the stream (0 when it does not exist yet).
    length: int
    # Whether the learners' consumer group exists (it does once one started).
    group: bool
    # Delivered to a learner and not yet acknowledged (None without the group).
    pending: int | None
    # Entries not yet delivered to the group (None without the group, or when
    # Redis cannot tell: before 7.0, or after entries were trimmed).
    lag: int | None


class LearningStatus(BaseModel):
    # Seconds since the oldest pending trajectory's turn ended (0 when none waits).
    lag_seconds: float
    # Waiting to be learned (retries included).
    pending: int
    # Learned.
    processed: int
    # Failed at least once (whatever became of them since).
    failed: int
    # Failed at least once and waiting for another attempt.
    retrying: int
    # Given up on after too many failures (the dead letters).
    dead: int
    oldest_pending_at: str | None = Field(json_schema_extra={"format": "date-time"})
    stream: StreamStatus


async def _stream_status(redis: Redis, stream: str) -> dict[str, Any]:
    length = int(await redis.xlen(stream))
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:
        groups = []  # no stream yet: no turn has ended since Redis started empty
    group = next((g for g in groups if g.get("name") == LEARNING_GROUP), None)
    if group is None:
        return {"length": length, "group": False, "pending": None, "lag": None}
    return {
        "length": length,
        "group": True,
        "pending": int(group.get("pending") or 0),
        "lag": await group_lag(redis, stream, group),
    }


@router.get(
    "/learning/status",
    response_model=LearningStatus,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="The learning centre's progress on the tenant's trajectories",
)
async def learning_status(state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    status = TrajectoryRecord.status
    pending = status == "pending"
    async with state.sessions() as session:
        row = (
            await session.execute(
                select(
                    func.count().filter(pending),
                    func.count().filter(status == "done"),
                    func.count().filter(TrajectoryRecord.attempts > 0),
                    func.count().filter(pending, TrajectoryRecord.attempts > 0),
                    func.count().filter(status == "dead"),
                    func.min(TrajectoryRecord.finished_at).filter(pending),
                    func.now(),
                ).where(TrajectoryRecord.tenant_id == tenant)
            )
        ).one()
    waiting, processed, failed, retrying, dead, oldest, now = row
    lag = max((now - oldest).total_seconds(), 0.0) if oldest is not None else 0.0
    return {
        "lag_seconds": round(lag, 3),
        "pending": waiting,
        "processed": processed,
        "failed": failed,
        "retrying": retrying,
        "dead": dead,
        "oldest_pending_at": oldest.isoformat() if oldest is not None else None,
        "stream": await _stream_status(state.redis, state.keys.trajectories),
    }
