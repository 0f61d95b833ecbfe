"""The bodies of ``/schedules``: a schedule as created and as read, and its runs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal, Self

from holdfast_shared.content import StorableObject, Text
from holdfast_shared.db.models import Schedule, ScheduleRun
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.memory.brain import USER_ID_PATTERN
from holdfast_shared.webhooks import WebhookSpec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from holdfast_gateway.outputschema import DESCRIPTION as OUTPUT_SCHEMA
from holdfast_gateway.schedules.when import check_cron, zone

Overlap = Literal["skip", "enqueue", "cancel_previous"]
CatchUp = Literal["latest", "all"]
ScheduleStatus = Literal["active", "paused", "completed"]
RunStatus = Literal["started", "waiting", "skipped", "failed"]

MAX_MESSAGE_CHARS = 1_000_000
# A year: a longer interval is a cron expression's or a one-shot's job.
MAX_INTERVAL_SECONDS = 366 * 86_400


_WHEN = ("cron", "interval_seconds", "at")


def _one_when_rule(schema: dict[str, Any]) -> None:
    """The description says what the validator checks: exactly one of the
    three, none of them null (absent is not given)."""
    for name in _WHEN:
        field = schema["properties"][name]
        given = [s for s in field.pop("anyOf", ()) if s.get("type") != "null"]
        field.update(given[0] if given else {})
        field.pop("default", None)
    schema["oneOf"] = [{"required": [name]} for name in _WHEN]


class CreateSchedule(BaseModel):
    """Exactly one of ``cron``, ``interval_seconds`` and ``at`` says when."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_one_when_rule)

    name: Annotated[str, Field(pattern=ID_PATTERN, description="unique within the tenant")]
    cron: Annotated[
        str | None,
        Field(
            min_length=9,
            max_length=200,
            description="five fields (minute hour day month weekday), in `timezone`",
        ),
    ] = None
    interval_seconds: Annotated[
        int | None,
        Field(ge=1, le=MAX_INTERVAL_SECONDS, description="due every this many seconds"),
    ] = None
    at: Annotated[
        datetime | None,
        Field(
            description="due once, then the schedule is completed; without an offset, "
            "a time in `timezone`"
        ),
    ] = None
    timezone: Annotated[
        str, Field(min_length=1, max_length=64, description="an IANA time zone")
    ] = "UTC"
    task_id: Annotated[
        str | None,
        Field(
            pattern=ID_PATTERN,
            description="each run is a turn of this task (default: a new task per run)",
        ),
    ] = None
    agent: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    message: Annotated[Text, Field(min_length=1, max_length=MAX_MESSAGE_CHARS)]
    user_id: Annotated[str | None, Field(pattern=USER_ID_PATTERN)] = None
    overlap: Overlap = Field(
        default="skip",
        description="a due time while the previous run's turn is active: `skip` it, "
        "`enqueue` it (it runs once that turn ends) or `cancel_previous` (cancel that turn, "
        "then run)",
    )
    catch_up: CatchUp = Field(
        default="latest",
        description="due times missed while no gateway ran: fire the `latest` only, or "
        "`all` (at most HOLDFAST_SCHEDULE_CATCH_UP_MAX, the latest)",
    )
    output_schema: StorableObject | None = Field(
        default=None, description=f"each run's, as on POST /execute: {OUTPUT_SCHEMA}"
    )
    webhook: WebhookSpec | None = Field(
        default=None,
        description="each run's, as on POST /execute: POST the turn's end and questions "
        "there, signed; default: the tenant's",
    )

    @field_validator(*_WHEN, mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        # Absent is None; an explicit null is not a value the description allows.
        if value is None:
            raise ValueError("leave the field out instead of sending null")
        return value

    # The error types below name what no schema can say (the fuzz checks let
    # them through): what cronsim parses, which zones the IANA database has.
    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            zone(value)
        except ValueError as exc:
            raise PydanticCustomError("unknown_timezone", str(exc)) from None
        return value

    @field_validator("cron")
    @classmethod
    def _five_fields(cls, value: str | None) -> str | None:
        if value is not None and len(value.split()) != 5:
            raise PydanticCustomError(
                "invalid_cron", "a cron expression has five fields: minute hour day month weekday"
            )
        return value

    @model_validator(mode="after")
    def _one_when(self) -> Self:
        given = [n for n in _WHEN if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of cron, interval_seconds and at"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.cron is not None:
            try:
                check_cron(self.cron, self.timezone)
            except ValueError as exc:
                raise PydanticCustomError("invalid_cron", str(exc)) from None
        if self.at is not None:
            if self.at.tzinfo is None:
                self.at = self.at.replace(tzinfo=zone(self.timezone))
            try:
                self.at = self.at.astimezone(UTC)
            except OverflowError:
                raise PydanticCustomError(
                    "datetime_out_of_range", "the instant is outside the years 1 to 9999 in UTC"
                ) from None
        return self


class ScheduleOut(BaseModel):
    name: str
    cron: str | None
    interval_seconds: int | None
    at: datetime | None
    timezone: str
    task_id: str | None
    agent: str | None
    message: str
    user_id: str | None
    overlap: Overlap
    catch_up: CatchUp
    output_schema: dict[str, Any] | None
    webhook: dict[str, Any] | None
    status: ScheduleStatus
    next_due_at: datetime | None = Field(description="null once a one-shot schedule fired")
    created_at: datetime

    @classmethod
    def of(cls, row: Schedule) -> ScheduleOut:
        return cls(
            name=row.name,
            cron=row.cron,
            interval_seconds=row.interval_seconds,
            at=row.at,
            timezone=row.timezone,
            task_id=row.task_id,
            agent=row.agent,
            message=row.message,
            user_id=row.user_id or None,
            overlap=row.overlap,
            catch_up=row.catch_up,
            output_schema=row.output_schema,
            webhook=row.webhook,
            status=row.status,
            next_due_at=row.next_due_at,
            created_at=row.created_at,
        )


class SchedulePage(BaseModel):
    schedules: list[ScheduleOut]


class RunOut(BaseModel):
    due_at: datetime
    status: RunStatus
    reason: str | None = Field(description="why a run was skipped or failed")
    task_id: str | None = Field(description="the task the run's turn is of (a started run)")
    turn_id: str | None
    turn_status: str | None = Field(description="the run's turn's status, as GET /tasks says")
    fired_at: datetime | None = Field(
        description="when the scheduler wrote the run's turn (its jitter: fired_at - due_at)"
    )

    @classmethod
    def of(cls, row: ScheduleRun, turn_status: str | None) -> RunOut:
        return cls(
            due_at=row.due_at,
            status=row.status,
            reason=row.reason,
            task_id=row.task_id,
            turn_id=row.turn_id,
            turn_status=turn_status,
            fired_at=row.fired_at,
        )


class RunPage(BaseModel):
    runs: list[RunOut] = Field(description="newest due time first")
