"""The per-task event log: append (``append.py``, with a turn's coalescing
:class:`Emitter`), read (``read.py``), and copy to
PostgreSQL (``copier.py``, the event copier; its SQL in ``sql.py``). The Lua
scripts are files of their own (``lua/``, loaded by ``scripts.py``).

Layout. Each task has one Redis stream (``Keys.events``) whose entry ids are
``<seq>-0`` and whose fields are ``t`` (type), ``ts`` (timestamp) and ``d``
(the finished wire JSON). Readers never re-serialise: ``d`` goes to the SSE
client as it is.

Seq and timestamp. The append script assigns both inside Redis, so every
process (gateway, any worker) agrees: ``seq`` is the last seq + 1 and
``timestamp`` is ``max(redis TIME in ms, last timestamp + 1)`` — a logical
clock that runs ahead of the wall clock only while a task emits more than one
event per millisecond, and so is strictly increasing and as exact a cursor as
``seq``.

Durability. Every append bumps the task in ``Keys.archive_dirty``; the event
copier (``copier.py``, :class:`Archiver`) copies new entries to the ``events`` table (idempotent on
``(task_id, seq)``) and only then lets the stream expire,
``channel_state_ttl_active`` seconds after its last archived event. A stream
with unarchived events never expires. When the stream is gone, the next
append continues numbering from PostgreSQL, and readers stitch PostgreSQL
(older) and Redis (newer) together.

The envelope. ``append.lua`` writes each event's envelope (``task_id``,
``turn_id``, ``seq``, ``timestamp``, then the body's fields) in the step that
assigns its seq and timestamp: it cannot be built before. Its one Python twin,
``events.envelope_json``, serves the gateway's first frame of a turn it has
just appended (from the append's answer, saving a read) and is the tests'
oracle: tests/shared/test_eventlog.py holds the two equal.
"""

from holdfast_shared.eventlog.append import Appending, Emitter, next_epoch
from holdfast_shared.eventlog.copier import Archiver, Copying
from holdfast_shared.eventlog.read import Reading
from holdfast_shared.eventlog.records import Appended, LoggedEvent
from holdfast_shared.eventlog.sql import Also, Writes, events_insert, execute_at_once, one_statement


class EventLog(Appending, Reading, Copying):
    """Append to, read from and copy task event logs. Safe to share across tasks."""


__all__ = [
    "Also",
    "Appended",
    "Archiver",
    "Emitter",
    "EventLog",
    "LoggedEvent",
    "Writes",
    "events_insert",
    "execute_at_once",
    "next_epoch",
    "one_statement",
]
