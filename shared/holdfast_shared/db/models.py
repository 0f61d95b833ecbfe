"""SQLAlchemy 2 models. Schema changes go through an Alembic migration."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSONB}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ApiKey(Base):
    """An API key, stored only as its SHA-256 hash (keys are 256-bit random)."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # The first characters, so an operator can tell keys apart without the secret.
    display_prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(200), default="default")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Task(Base):
    """A conversation with its turns, event log and workspace.

    ``id`` is minted by the engine (:func:`~holdfast_shared.ids.new_task_id`)
    and never reused: every row, Redis key and workspace of the task is keyed
    by it. ``name`` is what the client calls the task (``task_id`` on the
    API): unique within its tenant only, and free again once the task is
    deleted, without a new task ever reaching the old one's data.
    """

    __tablename__ = "tasks"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_tasks_tenant_id_name"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    # The agent's scratchpad ({key: value}) as the last turn left it; the live
    # copy is in Redis while the task is active (context engine).
    working_memory: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # Provider-reported prompt tokens / the local estimate, learned per task.
    token_calibration: Mapped[float | None] = mapped_column(Float)
    agent: Mapped[str | None] = mapped_column(String(128))
    model: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )


class Turn(Base):
    """One user message and the agent's whole response to it."""

    __tablename__ = "turns"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    # queued → running ⇄ parked (waiting for a human) → completed | errored | cancelled
    status: Mapped[str] = mapped_column(String(16), default="queued")
    stop_reason: Mapped[str | None] = mapped_column(String(64))
    # The worker running the turn holds it until lease_until and renews it;
    # a turn whose lease ran out is taken over (see loop-worker lease.py).
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    # What the turn runs with, so any worker can resume it from the row alone.
    agent: Mapped[str | None] = mapped_column(String(128))
    model: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Message(Base):
    """A conversation message. ``content`` is a list of provider-neutral blocks."""

    __tablename__ = "messages"
    __table_args__ = (UniqueConstraint("turn_id", "position"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    turn_id: Mapped[str] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"))
    # 0 is the user's message; the model's iterations follow from 1.
    position: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class EventRecord(Base):
    """The durable copy of a task's event log, kept forever.

    ``data`` is the exact wire JSON as text (not JSONB, which would reorder
    keys), so a replay from PostgreSQL is byte-identical to one from Redis.
    """

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_task_timestamp", "task_id", "timestamp"),)

    task_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    turn_id: Mapped[str | None] = mapped_column(String(64))
    type: Mapped[str] = mapped_column(String(64))
    timestamp: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[str] = mapped_column(Text)


class ChannelStateSnapshot(Base):
    """A checkpoint of a running turn's loop state (see loop-worker ``state.py``)."""

    __tablename__ = "channel_state_snapshots"
    __table_args__ = (
        Index("ix_snapshots_task_created", "task_id", "created_at"),
        Index("ix_snapshots_turn_id", "turn_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(String(128))
    turn_id: Mapped[str] = mapped_column(String(64))
    # model_call | tool_result | hitl | shutdown
    reason: Mapped[str] = mapped_column(String(32))
    state: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class ToolResultRecord(Base):
    """A tool call's outcome, keyed by the model's call id: the idempotency record.

    A row is claimed (``running``) before the tool runs and completed after,
    so a redelivered call finds it and never runs the tool twice.
    """

    __tablename__ = "tool_results"

    # Scoped by task: a call id repeated by a model in another task must never
    # return this task's result.
    task_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tool_call_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    turn_id: Mapped[str] = mapped_column(String(64))
    tool: Mapped[str] = mapped_column(String(128))
    input: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # running | done
    status: Mapped[str] = mapped_column(String(16))
    output: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    error: Mapped[str | None] = mapped_column(Text)
    runner: Mapped[str | None] = mapped_column(String(128))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class HitlRequestRecord(Base):
    """A question to the user (a permission prompt or the model's own question)."""

    __tablename__ = "hitl_requests"
    __table_args__ = (Index("ix_hitl_tenant_status", "tenant_id", "status"),)

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    task_id: Mapped[str] = mapped_column(String(128), index=True)
    turn_id: Mapped[str] = mapped_column(String(64))
    # permission | question
    kind: Mapped[str] = mapped_column(String(16))
    question: Mapped[str] = mapped_column(Text)
    tool_call: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # pending | answered | expired
    status: Mapped[str] = mapped_column(String(16), default="pending")
    answer: Mapped[str | None] = mapped_column(Text)
    feedback: Mapped[str | None] = mapped_column(Text)
    # {"blocks": [...]}: content the user attached to the answer (images, files).
    answer_content: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    answered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ContextSummary(Base):
    """A summary standing in for a task's oldest messages in the model's context.

    It covers every message of the task with ``id <= last_message_id`` (an
    earlier summary's text included), made by the compaction orchestrator;
    the messages themselves stay for replay and export. One per range: a
    turn taken over during a compaction reuses the summary if it was written.
    """

    __tablename__ = "context_summaries"
    __table_args__ = (UniqueConstraint("task_id", "last_message_id"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    last_message_id: Mapped[int] = mapped_column(BigInteger)
    summary: Mapped[str] = mapped_column(Text)
    summarized_messages: Mapped[int] = mapped_column(Integer)
    summary_tokens: Mapped[int] = mapped_column(Integer)
    tokens_before: Mapped[int] = mapped_column(Integer)
    tokens_after: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
