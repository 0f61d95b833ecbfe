"""``/schedules``: a message sent as a turn on a cron expression, an interval or once.

Creating, pausing, resuming and deleting write the schedule's row; the
scheduler (``holdfast_gateway.schedules``) fires it, on whichever gateway
locks it first. A run is a normal turn — of a new task per run, or of the
schedule's ``task_id`` — and ``GET /schedules/{name}/runs`` lists each due
time with what became of it.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Query, Response
from holdfast_shared.db.models import Schedule, ScheduleRun, Turn
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN, new_id
from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert

from holdfast_gateway import errors
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep, require_agent
from holdfast_gateway.errors import ApiError
from holdfast_gateway.forks import invalid_field
from holdfast_gateway.outputschema import checked
from holdfast_gateway.schedules.firing import when_of
from holdfast_gateway.schedules.when import When
from holdfast_gateway.schedules.wire import (
    CreateSchedule,
    RunOut,
    RunPage,
    ScheduleOut,
    SchedulePage,
)
from holdfast_gateway.state import GatewayState
from holdfast_gateway.webhooks import accepted

router = APIRouter(prefix="/schedules", tags=["schedules"])

ScheduleName = Annotated[str, Path(pattern=ID_PATTERN, description="the schedule's name")]


def _not_found(name: str) -> ApiError:
    return ApiError(
        404, ErrorCode.SCHEDULE_NOT_FOUND, f"schedule {name!r} not found", {"name": name}
    )


async def _find(state: GatewayState, tenant: str, name: str) -> Schedule:
    async with state.sessions() as session:
        row = await session.scalar(
            select(Schedule).where(Schedule.tenant_id == tenant, Schedule.name == name)
        )
    if row is None:
        raise _not_found(name)
    return row


@router.post(
    "",
    status_code=201,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404, 409),
    summary="Create a schedule",
)
async def create_schedule(
    state: StateDep, tenant: TenantDep, body: Annotated[CreateSchedule, Body()]
) -> ScheduleOut:
    # An unknown agent (or another tenant's) is a 404 before anything is written.
    await require_agent(state, tenant, body.agent)
    output_schema = checked(body.output_schema)
    webhook = await accepted(state, tenant, body.webhook, ("body", "webhook"))
    now = state.clock.now()
    when = When(
        timezone=body.timezone,
        anchor_at=now,
        cron=body.cron,
        interval_seconds=body.interval_seconds,
        at=body.at,
    )
    next_due = when.next_after(now)
    if next_due is None:
        # Time passes: no description can say which instants are still to come.
        raise invalid_field("at", "the time is in the past", "in_the_past")
    async with state.sessions.begin() as session:
        created = await session.scalar(
            insert(Schedule)
            .values(
                id=new_id("sched"),
                tenant_id=tenant,
                name=body.name,
                cron=body.cron,
                interval_seconds=body.interval_seconds,
                at=body.at,
                timezone=body.timezone,
                anchor_at=now,
                task_id=body.task_id,
                agent=body.agent,
                message=body.message,
                user_id=body.user_id or "",
                overlap=body.overlap,
                catch_up=body.catch_up,
                output_schema=output_schema,
                webhook=webhook,
                status="active",
                next_due_at=next_due,
            )
            .on_conflict_do_nothing(constraint="uq_schedules_tenant_id_name")
            .returning(Schedule)
        )
        if created is None:
            raise ApiError(
                409,
                ErrorCode.SCHEDULE_EXISTS,
                f"a schedule named {body.name!r} exists; delete it first or pick another name",
                {"name": body.name},
            )
        out = ScheduleOut.of(created)
    state.schedules_changed.set()
    return out


@router.get(
    "",
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="List the tenant's schedules",
)
async def list_schedules(state: StateDep, tenant: TenantDep) -> SchedulePage:
    async with state.sessions() as session:
        rows = await session.scalars(
            select(Schedule).where(Schedule.tenant_id == tenant).order_by(Schedule.name)
        )
        return SchedulePage(schedules=[ScheduleOut.of(row) for row in rows])


@router.get(
    "/{name}",
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="Get a schedule",
)
async def get_schedule(state: StateDep, tenant: TenantDep, name: ScheduleName) -> ScheduleOut:
    return ScheduleOut.of(await _find(state, tenant, name))


async def _set_status(state: GatewayState, tenant: str, name: str, paused: bool) -> ScheduleOut:
    async with state.sessions.begin() as session:
        row = await session.scalar(
            select(Schedule)
            .where(Schedule.tenant_id == tenant, Schedule.name == name)
            .with_for_update(key_share=True)
        )
        if row is None:
            raise _not_found(name)
        if paused and row.status == "active":
            row.status = "paused"
        elif not paused and row.status == "paused":
            # Due times that passed while paused are not caught up: it goes on from now.
            row.next_due_at = when_of(row).next_after(state.clock.now())
            row.status = "active" if row.next_due_at is not None else "completed"
        await session.flush()
        await session.refresh(row)
        out = ScheduleOut.of(row)
    state.schedules_changed.set()
    return out


@router.post(
    "/{name}/pause",
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="Pause a schedule: no due time fires until it is resumed",
)
async def pause_schedule(state: StateDep, tenant: TenantDep, name: ScheduleName) -> ScheduleOut:
    return await _set_status(state, tenant, name, paused=True)


@router.post(
    "/{name}/resume",
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="Resume a paused schedule from its next due time after now",
)
async def resume_schedule(state: StateDep, tenant: TenantDep, name: ScheduleName) -> ScheduleOut:
    return await _set_status(state, tenant, name, paused=False)


@router.delete(
    "/{name}",
    status_code=204,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="Delete a schedule and its runs' records (the runs' tasks stay)",
)
async def delete_schedule(state: StateDep, tenant: TenantDep, name: ScheduleName) -> Response:
    async with state.sessions.begin() as session:
        gone = await session.scalar(
            delete(Schedule)
            .where(Schedule.tenant_id == tenant, Schedule.name == name)
            .returning(Schedule.id)
        )
    if gone is None:
        raise _not_found(name)
    return Response(status_code=204)


@router.get(
    "/{name}/runs",
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="A schedule's runs, newest due time first",
)
async def list_runs(
    state: StateDep,
    tenant: TenantDep,
    name: ScheduleName,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> RunPage:
    row = await _find(state, tenant, name)
    async with state.sessions() as session:
        found = await session.execute(
            select(ScheduleRun, Turn.status)
            .join(Turn, Turn.id == ScheduleRun.turn_id, isouter=True)
            .where(ScheduleRun.schedule_id == row.id)
            .order_by(ScheduleRun.due_at.desc())
            .limit(limit)
        )
        return RunPage(runs=[RunOut.of(run, status) for run, status in found])
