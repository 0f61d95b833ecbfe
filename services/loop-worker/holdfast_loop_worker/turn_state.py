"""A turn's loop state, and its snapshots in ``channel_state_snapshots``.

The conversation itself is already durable (every model call's message and
every batch of tool results is a ``messages`` row), so a snapshot holds only
what the loop needs to pick up where it was:

* ``stage`` — what comes next: ``model`` (a model call), ``tools`` (run the
  ``pending`` calls), ``final`` (emit usage and ``completed``);
* ``pending`` — the calls of the last model answer, each with its outcome
  once known and the HITL request it waits on;
* ``position``, ``iteration``, ``usage``, ``active_ms`` (time spent running,
  for the deadline), ``last_seq`` (the turn's last event covered by the
  snapshot: anything after it belongs to a step that was cut off);
* ``working_memory`` and ``calibration``, the context engine's per-task
  state, so a turn taken over keeps the agent's notes.

Snapshots are written after every model call, after every tool result, when
a HITL request parks the turn, and on shutdown; they expire after the active
TTL, or the HITL TTL for a parked turn.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from holdfast_shared.db.models import ChannelStateSnapshot
from sqlalchemy import Insert, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

Stage = Literal["model", "tools", "final"]


@dataclass
class PendingCall:
    id: str
    name: str
    input: dict[str, Any]
    outcome: dict[str, Any] | None = None
    hitl_request: str | None = None
    # Its hitl_request event was logged. Parking snapshots after that event, so a
    # resume's scan of the log past the snapshot no longer shows it.
    hitl_announced: bool = False
    # The question settling its unknown outcome (an effectful call whose runner
    # was lost: turn/hitl.py), and whether its events were logged.
    settle_request: str | None = None
    settle_announced: bool = False
    # The questions of this call whose hitl_resolved was logged: a later park (an
    # outcome_unknown after the permission) snapshots past that event, so a resume's
    # scan of the log no longer shows it and would log the answer again.
    resolved: list[str] = field(default_factory=list)


@dataclass
class TurnState:
    stage: Stage = "model"
    position: int = 1
    iteration: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    pending: list[PendingCall] = field(default_factory=list)
    stop_reason: str | None = None
    last_seq: int = 0
    active_ms: int = 0
    # The task's working memory as this turn has it (context/working_memory.py);
    # a snapshot written before these fields existed reads the defaults.
    working_memory: dict[str, str] = field(default_factory=dict)
    # Provider-reported prompt tokens per locally estimated one (context/tokens.py).
    calibration: float = 1.0
    # A turn with an output schema (turn/result.py): the final answers checked,
    # the valid one ({"value": ...}), or the errors of the last invalid one.
    answers: int = 0
    result: dict[str, Any] | None = None
    result_errors: list[dict[str, str]] | None = None
    # The usage of the subagents it delegated to (turn/delegation.py), by child
    # task name: each one's last reported totals (their own rows count them).
    subagent_usage: dict[str, dict[str, int]] = field(default_factory=dict)

    def add_usage(self, counts: dict[str, int]) -> None:
        for name, value in counts.items():
            self.usage[name] = self.usage.get(name, 0) + value

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TurnState:
        pending = [PendingCall(**call) for call in data.get("pending", [])]
        return cls(**{**data, "pending": pending})

    def copy(self) -> TurnState:
        return TurnState.from_json(self.to_json())


def cut_off(boundary: TurnState, now: TurnState) -> TurnState:
    """What a snapshot taken in the middle of a step keeps (a hand-back, a pause
    that cuts a model call): the state of the last boundary ``boundary``, with
    the time and usage counted since (``now``'s: the cut-off call was billed).

    Not ``now`` itself: a step changes the state before its own snapshot
    commits (the model step sets stage ``final`` and takes the position of its
    message), and a stop that lands in that snapshot would keep a finished
    stage whose message never got stored: the resumed turn would end without
    the answer (the cluster chaos run of 2026-11-27).
    """
    kept = boundary.copy()
    kept.active_ms = now.active_ms
    kept.usage = dict(now.usage)
    kept.subagent_usage = dict(now.subagent_usage)
    kept.calibration = now.calibration
    return kept


# How long a parked turn's snapshot (and its task's lock) outlives its question.
PARKED_GRACE = timedelta(hours=1)


class Snapshots:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        active_ttl_seconds: int,
        hitl_ttl_seconds: int,
        reads: async_sessionmaker[AsyncSession] | None = None,
    ) -> None:
        self.sessions = sessions
        self.reads = reads or sessions
        self.active_ttl = timedelta(seconds=active_ttl_seconds)
        # A parked turn's snapshot outlives its question by PARKED_GRACE: the
        # question's expiry is acted on by a sweep and a resume, which need the
        # snapshot to end the turn as "expired"; had it expired with the
        # question, the resume would find nothing and ask again.
        self.hitl_ttl = timedelta(seconds=hitl_ttl_seconds) + PARKED_GRACE

    async def save(self, task_id: str, turn_id: str, reason: str, state: TurnState) -> None:
        async with self.sessions.begin() as session:
            self.add(session, task_id, turn_id, reason, state.to_json())

    def add(
        self,
        session: AsyncSession,
        task_id: str,
        turn_id: str,
        reason: str,
        state_json: dict[str, Any],
    ) -> None:
        """Add a snapshot (``TurnState.to_json()``) to ``session``'s transaction
        (committed with whatever else it holds)."""
        ttl = self.hitl_ttl if reason == "hitl" else self.active_ttl
        session.add(
            ChannelStateSnapshot(
                task_id=task_id,
                turn_id=turn_id,
                reason=reason,
                state=state_json,
                expires_at=datetime.now(UTC) + ttl,
            )
        )

    def statement(
        self, task_id: str, turn_id: str, reason: str, state_json: dict[str, Any]
    ) -> Insert:
        """The snapshot (``TurnState.to_json()``) as one INSERT, for a caller that sends
        it with other writes in one statement (``EventLog``'s ``Writes``: no ORM flush,
        no transaction of its own)."""
        ttl = self.hitl_ttl if reason == "hitl" else self.active_ttl
        return insert(ChannelStateSnapshot).values(
            task_id=task_id,
            turn_id=turn_id,
            reason=reason,
            state=state_json,
            expires_at=datetime.now(UTC) + ttl,
        )

    async def keep_latest_while_parked(self, session: AsyncSession, turn_id: str) -> None:
        """The turn's newest snapshot kept as long as a question may wait (a paused
        turn's: a pause may last that long too)."""
        newest = (
            select(ChannelStateSnapshot.id)
            .where(ChannelStateSnapshot.turn_id == turn_id)
            .order_by(ChannelStateSnapshot.id.desc())
            .limit(1)
            .scalar_subquery()
        )
        await session.execute(
            update(ChannelStateSnapshot)
            .where(ChannelStateSnapshot.id == newest)
            .values(expires_at=datetime.now(UTC) + self.hitl_ttl)
        )

    async def latest(self, turn_id: str) -> TurnState | None:
        """The turn's newest snapshot that has not expired, if any."""
        async with self.reads() as session:
            row = await session.scalar(
                select(ChannelStateSnapshot.state)
                .where(
                    ChannelStateSnapshot.turn_id == turn_id,
                    ChannelStateSnapshot.expires_at > datetime.now(UTC),
                )
                .order_by(ChannelStateSnapshot.id.desc())
                .limit(1)
            )
        return None if row is None else TurnState.from_json(row)
