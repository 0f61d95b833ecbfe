"""Process-wide logging set-up, the same format in every service.

Two formats (``HOLDFAST_LOG_FORMAT``): ``text``, a line for people, and
``json``, one JSON object per line for a log pipeline: ``time`` (ISO 8601,
UTC), ``level``, ``service``, ``logger``, ``message``, ``exc_info`` when
there is a traceback, and ``task_id`` / ``turn_id`` while a turn or a tool
call is being handled.

The ids come from context variables (:func:`bind_turn`, :func:`turn_log_context`),
set where a turn or a tool call starts: every record logged from that asyncio
task, or any task it creates (they copy the context), carries them without
any logging call having to pass them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Literal

import orjson

LogFormat = Literal["text", "json"]

_task_id: ContextVar[str | None] = ContextVar("holdfast_log_task_id", default=None)
_turn_id: ContextVar[str | None] = ContextVar("holdfast_log_turn_id", default=None)


@contextlib.contextmanager
def turn_log_context(task_id: str, turn_id: str) -> Iterator[None]:
    """Records logged inside carry ``task_id`` and ``turn_id`` (JSON format)."""
    task_token = _task_id.set(task_id)
    turn_token = _turn_id.set(turn_id)
    try:
        yield
    finally:
        _turn_id.reset(turn_token)
        _task_id.reset(task_token)


def bind_turn(task_id: str, turn_id: str) -> None:
    """Records logged from here to the end of the current asyncio task carry the
    turn's ids. For a task that handles one turn or one tool call (each runs in
    its own): its closing log lines, after the work itself, carry them too."""
    _task_id.set(task_id)
    _turn_id.set(turn_id)


def current_turn() -> tuple[str | None, str | None]:
    """The (task_id, turn_id) of the turn being handled here, if any."""
    return _task_id.get(), _turn_id.get()


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in messages are escaped)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        task_id, turn_id = _task_id.get(), _turn_id.get()
        if task_id is not None:
            line["task_id"] = task_id
        if turn_id is not None:
            line["turn_id"] = turn_id
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        # default=str: a message argument orjson cannot encode never loses the record.
        return orjson.dumps(line, default=str).decode()


def configure_logging(level: str, service: str, log_format: LogFormat = "text") -> None:
    """Send every logger's records to stderr in ``log_format``, from ``level`` up."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s")
        )
    # force: uvicorn or a library may have installed a handler first.
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
