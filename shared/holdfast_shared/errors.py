"""Stable error codes: the ``error`` field of error bodies and ``error`` events."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    INVALID_KEY = "INVALID_KEY"
    TASK_NOT_FOUND = "TASK_NOT_FOUND"
    TURN_IN_PROGRESS = "TURN_IN_PROGRESS"
    INVALID_REQUEST = "INVALID_REQUEST"
    UNKNOWN_MODEL = "UNKNOWN_MODEL"
    INTERNAL = "INTERNAL"
    LLM_RATE_LIMITED = "LLM_RATE_LIMITED"
    LLM_PROVIDER_ERROR = "LLM_PROVIDER_ERROR"
    CONTEXT_OVERFLOW = "CONTEXT_OVERFLOW"
    MAX_ITERATIONS = "MAX_ITERATIONS"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
