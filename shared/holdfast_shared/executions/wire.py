"""The /v1/execution wire types: request bodies and the execution object.

Declared once here and parsed only through these models. Bodies forbid
unknown fields, so a misspelt option is a 422 naming it rather than a
setting silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from holdfast_shared.content import StorableObject, Text
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.webhooks import WebhookSpec

Status = Literal["running", "paused", "completed", "failed", "terminated"]
STATUSES: tuple[Status, ...] = ("running", "paused", "completed", "failed", "terminated")

# Below the body cap (HOLDFAST_MAX_BODY_BYTES, 8 MiB) even at 12 JSON bytes a
# character (an escaped surrogate pair), so an overlong input is a 422 naming it.
MAX_INPUT_CHARS = 500_000
# A day of active time per attempt is already more than a turn deadline allows.
MAX_DURATION_SECONDS = 30 * 24 * 3600


def _not_a_boolean(value: Any) -> Any:
    # JSON's true is no count of seconds or attempts (pydantic would take it as 1).
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


_NUMBER = BeforeValidator(_not_a_boolean)


class RetryConfig(BaseModel):
    """A failed step is retried from the last checkpoint, up to ``max_attempts``
    more runs, ``backoff_seconds`` after each failure."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_attempts: Annotated[int, Field(ge=0, le=100), _NUMBER]
    backoff_seconds: Annotated[float, Field(ge=0, le=3600), _NUMBER] = 1.0


class ExecutionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_duration_seconds: (
        Annotated[float, Field(ge=0.001, le=MAX_DURATION_SECONDS), _NUMBER] | None
    ) = None
    checkpoint_interval_seconds: (
        Annotated[float, Field(ge=0.001, le=MAX_DURATION_SECONDS), _NUMBER] | None
    ) = None
    retry: RetryConfig | None = None


class CreateExecution(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: Annotated[Text, Field(min_length=1, max_length=200)]
    description: Annotated[Text, Field(max_length=10_000)] | None = None
    agent_id: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    task_type: Annotated[Text, Field(min_length=1, max_length=128)] | None = None
    input: Annotated[Text, Field(min_length=1, max_length=MAX_INPUT_CHARS)]
    state: StorableObject = Field(default_factory=dict)
    config: ExecutionConfig = Field(default_factory=ExecutionConfig)
    # A JSON Schema the answer must meet (checked by the gateway: outputschema.py).
    output_schema: StorableObject | None = Field(
        default=None,
        description="a JSON Schema the execution's final answer must meet; the validated "
        "answer is the execution's `result` (README, Structured results)",
    )
    # Completion webhooks: where the turn's end and questions are posted (README).
    webhook: WebhookSpec | None = None


class SaveCheckpoint(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    label: Annotated[Text, Field(min_length=1, max_length=200)] | None = None
    # Given: it becomes the execution's state as well.
    state: StorableObject | None = None


class ResumeExecution(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # Roll back to this checkpoint first; absent: go on from where it paused.
    checkpoint_id: Annotated[str, Field(pattern=ID_PATTERN)] | None = None


class CheckpointOut(BaseModel):
    id: str
    label: str | None
    state: dict[str, Any]
    timestamp: str


class ExecutionOut(BaseModel):
    id: str
    name: str
    description: str | None
    agent_id: str | None
    task_type: str | None
    status: Status
    state: dict[str, Any]
    checkpoints: list[CheckpointOut]
    config: dict[str, Any]
    elapsed_seconds: int
    started_at: str
    completed_at: str | None
    updated_at: str
    # Why a failed execution failed (null otherwise), and how many retries ran.
    failure_reason: str | None = None
    attempts: int = 0
    # With an output_schema: the validated answer, once its turn completed.
    result: Any = None


class ExecutionPage(BaseModel):
    executions: list[ExecutionOut]
    # Pass as ``cursor`` for the next page; null on the last one.
    next_cursor: str | None
