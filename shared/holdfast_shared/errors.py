"""Stable error codes, and the one family of exceptions that carries them.

``ErrorCode`` values are the ``error`` field of error bodies and ``error``
events. :class:`HoldfastError` is the base of every error the engine reports;
:class:`TurnSignal` the base of the control-flow signals a turn's conductor
alone may catch (see there why they are ``BaseException``s).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    INVALID_KEY = "INVALID_KEY"
    TASK_NOT_FOUND = "TASK_NOT_FOUND"
    TURN_IN_PROGRESS = "TURN_IN_PROGRESS"
    # /execute with on_busy: the task already has HOLDFAST_MAX_QUEUED_TURNS messages waiting.
    TURN_QUEUE_FULL = "TURN_QUEUE_FULL"
    # /execute: an Idempotency-Key sent again with another request.
    IDEMPOTENCY_KEY_REUSED = "IDEMPOTENCY_KEY_REUSED"
    INVALID_REQUEST = "INVALID_REQUEST"
    NOT_FOUND = "NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    BODY_TOO_LARGE = "BODY_TOO_LARGE"
    UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"
    RATE_LIMITED = "RATE_LIMITED"
    # The tenant keeps HOLDFAST_TENANT_MAX_STORAGE_BYTES or more (507, before any write).
    STORAGE_QUOTA_EXCEEDED = "STORAGE_QUOTA_EXCEEDED"
    UNKNOWN_MODEL = "UNKNOWN_MODEL"
    MODEL_UNAVAILABLE = "MODEL_UNAVAILABLE"
    # A media item the turn's model cannot take (see holdfast_shared.media_support).
    UNSUPPORTED_MEDIA = "UNSUPPORTED_MEDIA"
    HITL_REQUIRED = "HITL_REQUIRED"
    HITL_NOT_FOUND = "HITL_NOT_FOUND"
    HITL_ALREADY_ANSWERED = "HITL_ALREADY_ANSWERED"
    HITL_EXPIRED = "HITL_EXPIRED"
    INTERNAL = "INTERNAL"
    UNAVAILABLE = "UNAVAILABLE"
    LLM_RATE_LIMITED = "LLM_RATE_LIMITED"
    LLM_PROVIDER_ERROR = "LLM_PROVIDER_ERROR"
    CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"
    MAX_ITERATIONS = "MAX_ITERATIONS"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    NO_RUNNING_TURN = "NO_RUNNING_TURN"
    CHANNEL_STATE_EXPIRED = "CHANNEL_STATE_EXPIRED"
    # Agents (/agents, the agent of /execute and of a running turn).
    AGENT_NOT_FOUND = "AGENT_NOT_FOUND"
    # POST /agents with a name taken, by a built-in or the tenant's own agent.
    AGENT_EXISTS = "AGENT_EXISTS"
    # PUT or DELETE of a built-in agent: they ship with the engine.
    AGENT_BUILTIN = "AGENT_BUILTIN"
    # Long-term memory (/memory): a fact the brain does not hold (also another tenant's).
    MEMORY_NOT_FOUND = "MEMORY_NOT_FOUND"
    # Skills (/skills, and the skill tool): no such skill for the tenant (also another tenant's).
    SKILL_NOT_FOUND = "SKILL_NOT_FOUND"
    # POST /skills with a name taken, by a built-in or the tenant's own skill.
    SKILL_EXISTS = "SKILL_EXISTS"
    # DELETE of a built-in skill: they ship with the engine.
    SKILL_BUILTIN = "SKILL_BUILTIN"
    # An uploaded skill over a size or file-count cap (413).
    SKILL_TOO_LARGE = "SKILL_TOO_LARGE"
    # The Asset Directory (/assets/servers): no such server for the tenant (also another tenant's).
    ASSET_NOT_FOUND = "ASSET_NOT_FOUND"
    # POST /assets/servers with a name the tenant already uses.
    ASSET_EXISTS = "ASSET_EXISTS"
    # The MCP server could not be reached or listed (or no tool-runner answered for it).
    ASSET_UNAVAILABLE = "ASSET_UNAVAILABLE"
    # A URL the engine would connect to for the tenant leads somewhere the outbound
    # policy refuses (loopback, private, metadata...; HOLDFAST_OUTBOUND_ALLOW).
    DESTINATION_NOT_ALLOWED = "DESTINATION_NOT_ALLOWED"
    # /webhooks/deliveries/{id}: no delivery of that id for the tenant (also another tenant's).
    WEBHOOK_DELIVERY_NOT_FOUND = "WEBHOOK_DELIVERY_NOT_FOUND"
    # GET /assets/servers/{name}/connect of a server that does not use oauth2.
    ASSET_NOT_OAUTH2 = "ASSET_NOT_OAUTH2"
    # An OAuth authorization that cannot complete (unknown or expired state, a refused code).
    ASSET_AUTHORIZATION_FAILED = "ASSET_AUTHORIZATION_FAILED"
    # Stream tokens (?token= of GET /execute/replay): malformed or not signed by
    # this deployment (401), past their expiry (401), or for another task (403).
    STREAM_TOKEN_INVALID = "STREAM_TOKEN_INVALID"
    STREAM_TOKEN_EXPIRED = "STREAM_TOKEN_EXPIRED"
    STREAM_TOKEN_WRONG_TASK = "STREAM_TOKEN_WRONG_TASK"
    # Executions (/v1/execution): none of that id for the tenant (also another tenant's).
    EXECUTION_NOT_FOUND = "EXECUTION_NOT_FOUND"
    # Pause of an execution that is not running; resume of one that is not paused.
    EXECUTION_NOT_RUNNING = "EXECUTION_NOT_RUNNING"
    EXECUTION_NOT_PAUSED = "EXECUTION_NOT_PAUSED"
    # Resume from a checkpoint the execution does not have.
    CHECKPOINT_NOT_FOUND = "CHECKPOINT_NOT_FOUND"
    # A task's files (/tasks/{id}/files): no such file or directory in the workspace
    # (404; also a path through a symlink), a path that would leave it (400), an
    # upload larger than the workspace's room (413), a Range past the file's end (416).
    FILE_NOT_FOUND = "FILE_NOT_FOUND"
    INVALID_PATH = "INVALID_PATH"
    WORKSPACE_FULL = "WORKSPACE_FULL"
    RANGE_NOT_SATISFIABLE = "RANGE_NOT_SATISFIABLE"
    # The execution's active time ran past its config.max_duration_seconds.
    EXECUTION_MAX_DURATION = "EXECUTION_MAX_DURATION"
    # output_schema: the model's answer was not valid JSON for the schema, twice
    # (once more asked with the errors); details.errors says why.
    OUTPUT_INVALID = "OUTPUT_INVALID"
    # /schedules: no schedule of that name (also another tenant's); the name is taken.
    SCHEDULE_NOT_FOUND = "SCHEDULE_NOT_FOUND"
    SCHEDULE_EXISTS = "SCHEDULE_EXISTS"


class HoldfastError(Exception):
    """Base of the engine's errors: a stable :class:`ErrorCode`, a message for
    people and optional details. What a client or the model is told about a
    failure comes from one of these."""

    def __init__(self, code: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


class TurnSignal(BaseException):
    """Base of the signals that steer a turn instead of reporting a failure.

    A ``BaseException``, as ``asyncio.CancelledError`` is: a broad ``except
    Exception`` — in a provider adapter, a tool wrapper, a retry helper — must
    never swallow one, or a parked turn would go on and a superseded writer
    would keep writing. Only the turn's conductor catches them.
    """


class Superseded(TurnSignal):
    """This writer's turn was taken over by another worker: it must stop writing."""


class Parked(TurnSignal):
    """The turn waits for a human (request ``request_id``); its worker lets go of it."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.request_id = request_id


class StepInterrupted(TurnSignal):
    """A model call failed after it had streamed output: the turn ends with
    ``error`` after storing ``content``, the partial output the client saw."""

    def __init__(self, error: HoldfastError, content: dict[str, Any]) -> None:
        super().__init__(error.message)
        self.error = error
        self.content = content
