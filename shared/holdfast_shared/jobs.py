"""Payloads that travel on Redis queues between services."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class TurnJob(BaseModel):
    """One turn to run: appended by the gateway to ``Keys.turns``.

    The user's message is already stored (``messages`` row ``message_id``) when
    the job is enqueued, so a job never carries the only copy of user input.
    """

    model_config = ConfigDict(frozen=True)

    task_id: str
    turn_id: str
    tenant_id: str
    message_id: int
    agent: str | None = None
    model: str | None = None
    direct: bool = False
    media: list[dict[str, Any]] = []
    enqueued_at_ms: int

    FIELD: ClassVar[str] = "job"

    def to_fields(self) -> dict[str, str]:
        return {self.FIELD: self.model_dump_json()}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes] | dict[str, str]) -> TurnJob:
        raw = dict(fields).get(cls.FIELD)  # type: ignore[call-overload]
        if raw is None:
            raise ValueError("turn job entry has no 'job' field")
        return cls.model_validate_json(raw)
