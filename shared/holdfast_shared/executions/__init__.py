"""Executions (``/v1/execution``): a task run with a goal, a state document,
checkpoints, pause and resume. ``wire`` holds the request and response types,
``store`` the rows and their status changes, ``rollback`` the return to a
checkpoint. An execution *is* a task: its id (``exec_…``) is the task's name.
"""

from holdfast_shared.executions.rollback import RollbackTarget, roll_back
from holdfast_shared.executions.wire import (
    STATUSES,
    CheckpointOut,
    CreateExecution,
    ExecutionConfig,
    ExecutionOut,
    ExecutionPage,
    ResumeExecution,
    RetryConfig,
    SaveCheckpoint,
    Status,
)

__all__ = [
    "STATUSES",
    "CheckpointOut",
    "CreateExecution",
    "ExecutionConfig",
    "ExecutionOut",
    "ExecutionPage",
    "ResumeExecution",
    "RetryConfig",
    "RollbackTarget",
    "SaveCheckpoint",
    "Status",
    "roll_back",
]
