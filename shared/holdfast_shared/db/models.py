"""SQLAlchemy 2 models. Schema changes go through an Alembic migration."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    Computed,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy import (
    text as sql,
)
from sqlalchemy.dialects.postgresql import JSON, JSONB, TSVECTOR
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
    # Written by the gateway at most once a minute per key (holdfast_gateway.auth),
    # so it is accurate to about that much and costs no write per request.
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Task(Base):
    """A conversation with its turns, event log and workspace.

    ``id`` is minted by the engine (:func:`~holdfast_shared.ids.new_task_id`)
    and never reused: every row, Redis key and workspace of the task is keyed
    by it. ``name`` is what the client calls the task (``task_id`` on the
    API): unique within its tenant only, and free again once the task is
    deleted, without a new task ever reaching the old one's data.
    """

    __tablename__ = "tasks"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="uq_tasks_tenant_id_name"),
        # GET /tasks: a tenant's tasks, newest activity first.
        Index("ix_tasks_tenant_activity", "tenant_id", "updated_at", "id"),
    )

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
    # A subagent's task: the task whose turn delegated to it (its ``id``), and
    # how deep it is (0: a task a client started; 1: its child; ...).
    parent_task_id: Mapped[str | None] = mapped_column(String(128), index=True)
    depth: Mapped[int] = mapped_column(Integer, server_default=sql("0"))
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
    # The end user the turn is for (``user_id`` on /execute): whose part of the
    # tenant's long-term memory it reads and feeds; "" is the tenant's own.
    user_id: Mapped[str] = mapped_column(String(128), server_default="")
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The turn's token totals ({input_tokens, output_tokens, ...}) and active
    # time, written with its end in one transaction (None while it runs: its
    # latest snapshot has them then). Read by GET /tasks/{task_id}.
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    active_ms: Mapped[int | None] = mapped_column(BigInteger)
    # ``output_schema`` on /execute or /v1/execution: the JSON Schema the turn's
    # answer must meet; ``result`` is that answer, validated, written with the
    # turn's end (GET /tasks/{task_id} and the execution carry the last one).
    # JSON, not JSONB: JSONB reorders an object's keys, and the order of a
    # schema's properties is the order a model writes them in (a "reasoning"
    # put before the "answer" on purpose would come after it).
    output_schema: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    result: Mapped[Any | None] = mapped_column(JSON)
    # ``webhook`` on /execute, /v1/execution or a schedule: {url, events}, where
    # the turn's end (and its questions) are posted (the tenant's default when None).
    webhook: Mapped[dict[str, Any] | None] = mapped_column(JSONB)


class ExecuteKey(Base):
    """A client's ``Idempotency-Key`` on ``POST /execute``: its message runs once.

    Written in the transaction that stores the message, so a request sent
    again with the key (its response lost, its gateway stalled) follows the
    turn the first one started instead of starting another
    (``holdfast_gateway/executekeys.py``). It lives as long as its turn.
    """

    __tablename__ = "execute_keys"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    # The request as validated, hashed: the same key on another request is an error.
    fingerprint: Mapped[str] = mapped_column(String(64))
    # Deferred: the key is recorded first in the message's transaction, before its
    # turn's row, so a second request with the key waits on it there.
    turn_id: Mapped[str] = mapped_column(
        ForeignKey("turns.id", ondelete="CASCADE", deferrable=True, initially="DEFERRED"),
        index=True,
    )
    # The task's last seq before the message: where a repeat looks for its turn.
    after_seq: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ConversationFork(Base):
    """A point where the conversation forked: the messages after ``after_message_id``
    (all of the task's, when None) left the current branch (see ``branches.py``).

    ``reason``: ``edit`` | ``retry`` (``POST /execute``) | ``rollback`` (an
    execution resumed from a checkpoint).
    """

    __tablename__ = "conversation_forks"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    reason: Mapped[str] = mapped_column(String(16))
    after_message_id: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Message(Base):
    """A conversation message. ``content`` is a list of provider-neutral blocks."""

    __tablename__ = "messages"
    __table_args__ = (
        UniqueConstraint("turn_id", "position"),
        # What the next model call reads: the current branch, in order.
        Index(
            "ix_messages_current",
            "task_id",
            "id",
            postgresql_where=sql("taken_off_by IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), index=True)
    turn_id: Mapped[str] = mapped_column(ForeignKey("turns.id", ondelete="CASCADE"))
    # 0 is the user's message; the model's iterations follow from 1.
    position: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    # The fork that took the message off the current branch; None: it is on it.
    taken_off_by: Mapped[str | None] = mapped_column(ForeignKey("conversation_forks.id"))


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
    """A checkpoint of a running turn's loop state (see loop-worker ``turn_state.py``)."""

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
    so a redelivered call finds it and never runs the tool twice. A call whose
    runner was lost mid-run is marked ``unknown``; only a later ``attempt``
    (the loop's retry of a read-only or idempotent call, or a person's
    ``retry``) claims it again.
    """

    __tablename__ = "tool_results"

    # Scoped by task: a call id repeated by a model in another task must never
    # return this task's result.
    task_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tool_call_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    turn_id: Mapped[str] = mapped_column(String(64))
    tool: Mapped[str] = mapped_column(String(128))
    input: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # running | done | unknown
    status: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer, server_default=sql("1"))
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


# -- long-term memory (the brain) ---------------------------------------------
#
# Every row below belongs to one brain: a tenant, and inside it an end user
# (``user_id``; "" for the tenant itself). Brains never see each other's rows.
# ``tsv`` columns are generated by PostgreSQL for full-text search; vectors,
# where pgvector is installed, live in ``memory_vectors`` (memory/vectors.py).

_FTS = "to_tsvector('english', {})"
# Full-text indexes without GIN's pending list: a fresh insert costs a little
# more, and no search pays for scanning a list of unmerged inserts (which grows
# between vacuums and made searches of a busy brain 20 times slower).
_GIN = {"fastupdate": "off"}


class TrajectoryRecord(Base):
    """What one turn did, written when it ends, for the learning centre.

    Its id is the turn's: writing it twice (a turn resumed after its end was
    logged) changes nothing. ``status`` is the learning centre's progress:
    pending → done, or dead after ``HOLDFAST_LEARNING_MAX_ATTEMPTS`` failures.
    """

    __tablename__ = "trajectories"
    __table_args__ = (
        Index("ix_trajectories_status_next", "status", "next_attempt_at"),
        Index("ix_trajectories_tenant_user", "tenant_id", "user_id"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    user_id: Mapped[str] = mapped_column(String(128), server_default="")
    # The engine's task id; no foreign key: what was learned outlives the task.
    task_id: Mapped[str] = mapped_column(String(128))
    # completed | errored | cancelled
    outcome: Mapped[str] = mapped_column(String(16))
    record: Mapped[dict[str, Any]] = mapped_column(JSONB)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    status: Mapped[str] = mapped_column(String(16), server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    processed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Episode(Base):
    """What happened in a turn (or a stretch of a task): with whom, the outcome, when."""

    __tablename__ = "memory_episodes"
    __table_args__ = (
        Index("ix_memory_episodes_brain", "tenant_id", "user_id", "occurred_at"),
        Index("ix_memory_episodes_tsv", "tsv", postgresql_using="gin", postgresql_with=_GIN),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    user_id: Mapped[str] = mapped_column(String(128), server_default="")
    task_id: Mapped[str | None] = mapped_column(String(128))
    # One episode per trajectory: a trajectory learned twice writes it once.
    trajectory_id: Mapped[str | None] = mapped_column(String(64), unique=True)
    text: Mapped[str] = mapped_column(Text)
    outcome: Mapped[str | None] = mapped_column(String(200))
    participants: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    tsv: Mapped[str] = mapped_column(TSVECTOR, Computed(_FTS.format("text"), persisted=True))


class Fact(Base):
    """An atomic piece of knowledge, with where it came from and how sure we are.

    Never overwritten: the same fact told again merges (its ``sources`` grow,
    its confidence rises); a fact contradicting a current one with the same
    ``key`` supersedes it — the old row gets ``valid_to`` and
    ``superseded_by`` and stays as history.
    """

    __tablename__ = "memory_facts"
    __table_args__ = (
        Index("ix_memory_facts_tsv", "tsv", postgresql_using="gin", postgresql_with=_GIN),
        Index(
            "ix_memory_facts_current_key",
            "tenant_id",
            "user_id",
            "key",
            postgresql_where=sql("valid_to IS NULL"),
        ),
        Index(
            "uq_memory_facts_current_norm",
            "tenant_id",
            "user_id",
            "norm",
            unique=True,
            postgresql_where=sql("valid_to IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    user_id: Mapped[str] = mapped_column(String(128), server_default="")
    text: Mapped[str] = mapped_column(Text)
    # The text folded (case, spacing, end punctuation): what "the same fact" means.
    norm: Mapped[str] = mapped_column(Text)
    # What the fact is about (e.g. "user.favourite_colour"): two current facts
    # never share one; None when the extractor named none.
    key: Mapped[str | None] = mapped_column(String(200))
    confidence: Mapped[float] = mapped_column(Float)
    # Trajectory ids (or "api", "tool:<task>", "import") that told it.
    sources: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    valid_from: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    valid_to: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    superseded_by: Mapped[str | None] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    tsv: Mapped[str] = mapped_column(TSVECTOR, Computed(_FTS.format("text"), persisted=True))


class Entity(Base):
    """A node of the social graph: a person, organisation, project, place…"""

    __tablename__ = "memory_entities"
    __table_args__ = (
        UniqueConstraint("tenant_id", "user_id", "kind", "norm", name="uq_memory_entities_name"),
        Index("ix_memory_entities_tsv", "tsv", postgresql_using="gin", postgresql_with=_GIN),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    user_id: Mapped[str] = mapped_column(String(128), server_default="")
    name: Mapped[str] = mapped_column(String(300))
    norm: Mapped[str] = mapped_column(String(300))
    # person | organisation | project | place | other
    kind: Mapped[str] = mapped_column(String(32))
    description: Mapped[str] = mapped_column(Text, server_default="")
    # Trajectory ids (or "api", "import") that mention it.
    evidence: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    tsv: Mapped[str] = mapped_column(
        TSVECTOR,
        Computed(_FTS.format("name || ' ' || description"), persisted=True),
    )


class Relation(Base):
    """An edge of the social graph (``source`` —relation→ ``target``), with evidence."""

    __tablename__ = "memory_relations"
    __table_args__ = (
        UniqueConstraint("source_id", "relation", "target_id", name="uq_memory_relations_edge"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    user_id: Mapped[str] = mapped_column(String(128), server_default="")
    source_id: Mapped[str] = mapped_column(
        ForeignKey("memory_entities.id", ondelete="CASCADE"), index=True
    )
    relation: Mapped[str] = mapped_column(String(100))
    target_id: Mapped[str] = mapped_column(
        ForeignKey("memory_entities.id", ondelete="CASCADE"), index=True
    )
    evidence: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class SoulVersion(Base):
    """One version of a brain's soul: who the user is, what they prefer.

    The current soul is the highest version; every earlier one is kept.
    """

    __tablename__ = "memory_souls"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    user_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    content: Mapped[str] = mapped_column(Text)
    # learning | api | import
    source: Mapped[str] = mapped_column(String(32))
    trajectory_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


# -- agents -------------------------------------------------------------------


class AgentRecord(Base):
    """A tenant's custom agent (``/agents``); built-in agents are files
    (``holdfast_shared/agents/builtin``) and never rows.

    Stored as the turn will run it: ``tools`` resolved (the default set when
    the client gave none) and ``permissions`` with a rule for each tool.
    """

    __tablename__ = "agents"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    description: Mapped[str] = mapped_column(Text)
    system_prompt: Mapped[str] = mapped_column(Text)
    # A preferred provider:model; None: the engine's default.
    model: Mapped[str | None] = mapped_column(String(200))
    tools: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    skills: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    # Asset Directory servers whose tools the agent may use.
    servers: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    # The agents it may delegate to (the ``delegate`` tool).
    subagents: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    # {tool: "allow" | "ask" | "deny"}
    permissions: Mapped[dict[str, str]] = mapped_column(JSONB, server_default=sql("'{}'::jsonb"))
    # {tool | server__tool | server__* | bash:<glob>: read_only | idempotent | effectful}
    effects: Mapped[dict[str, str]] = mapped_column(JSONB, server_default=sql("'{}'::jsonb"))
    network: Mapped[bool] = mapped_column(Boolean, server_default=sql("false"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )


# -- skills -------------------------------------------------------------------


class SkillRecord(Base):
    """A tenant's own skill (``/skills``); built-in skills are folders
    (``holdfast_shared/skills/builtin``) and never rows.

    ``body`` is SKILL.md's Markdown after its front matter; ``files`` the
    folder's other files as ``{relative path: base64 of the bytes}`` —
    validated once at upload, so nothing reads an untrusted archive again.
    ``digest`` is the SHA-256 of the skill's canonical content: the tool
    runner's cache key for the materialised folder.
    """

    __tablename__ = "skills"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    description: Mapped[str] = mapped_column(Text)
    body: Mapped[str] = mapped_column(Text)
    files: Mapped[dict[str, str]] = mapped_column(JSONB, server_default=sql("'{}'::jsonb"))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )


# -- the Asset Directory ----------------------------------------------------------


class AssetServer(Base):
    """A tenant's MCP server in the Asset Directory (``/assets/servers``).

    ``env`` and ``credentials`` are Fernet tokens (``holdfast_shared.assets.vault``,
    key ``HOLDFAST_ASSET_ENCRYPTION_KEY``), never plain text: the JSON of the stdio
    server's environment, and of the credentials (a bearer token, or the OAuth
    client, tokens, expiry and a pending authorization). ``oauth_state`` is the
    SHA-256 of a pending authorization's ``state``, which is how the callback
    (it carries no API key) finds its server. ``tools`` is what the server
    offered when last listed: name, description, inputSchema, annotations.
    """

    __tablename__ = "asset_servers"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    # streamable-http | stdio
    transport: Mapped[str] = mapped_column(String(32))
    url: Mapped[str | None] = mapped_column(Text)
    command: Mapped[str | None] = mapped_column(Text)
    args: Mapped[list[str]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    env: Mapped[str | None] = mapped_column(Text)
    # none | bearer | oauth2
    auth_type: Mapped[str] = mapped_column(String(16), server_default="none")
    credentials: Mapped[str | None] = mapped_column(Text)
    # ready | needs_authorization
    status: Mapped[str] = mapped_column(String(32), server_default="ready")
    oauth_state: Mapped[str | None] = mapped_column(String(64), unique=True)
    tools: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, server_default=sql("'[]'::jsonb"))
    # {the server's tool name: effect class}, over its annotations'.
    effects: Mapped[dict[str, str]] = mapped_column(JSONB, server_default=sql("'{}'::jsonb"))
    tools_listed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )


# -- workspace archives (workspace_checkpoints/) ---------------------------------------


class WorkspaceBlob(Base):
    """One file content of a tenant's workspaces, stored once: zstd-compressed,
    keyed by the SHA-256 of the uncompressed bytes."""

    __tablename__ = "workspace_blobs"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class WorkspaceArchive(Base):
    """A checkpoint of a task's workspace: its manifest (path → blob hash, mode,
    size, mtime; symlink targets; directories), immutable once written."""

    __tablename__ = "workspace_archives"
    __table_args__ = (Index("ix_workspace_archives_task_created", "task_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"))
    manifest: Mapped[dict[str, Any]] = mapped_column(JSONB)
    files: Mapped[int] = mapped_column(Integer)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    # checkpoint | turn_end | hibernate | restore
    reason: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class WorkspaceHead(Base):
    """The archive a task's workspace currently is (its last checkpoint, or what it
    was rolled back to): what a tool-runner without the workspace restores."""

    __tablename__ = "workspace_heads"

    task_id: Mapped[str] = mapped_column(
        ForeignKey("tasks.id", ondelete="CASCADE"), primary_key=True
    )
    tenant_id: Mapped[str] = mapped_column(String(64))
    archive_id: Mapped[str] = mapped_column(ForeignKey("workspace_archives.id", ondelete="CASCADE"))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )


# -- executions (the /v1/execution API; holdfast_shared/executions/) -----------------


class Execution(Base):
    """A task run as an execution: a goal, a state document, a status, checkpoints.

    ``id`` (``exec_…``) is also the task's name (the ``task_id`` clients use);
    ``task_id`` the engine's ``Task.id``. ``turn_id`` is the turn that runs the
    work (the execution's one turn; a retry continues it). Active time is
    ``active_ms`` plus, while running, the time since ``running_since``.
    """

    __tablename__ = "executions"
    __table_args__ = (
        # GET /v1/execution: a tenant's executions, newest first, by status.
        Index("ix_executions_tenant_started", "tenant_id", "started_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    task_id: Mapped[str] = mapped_column(ForeignKey("tasks.id", ondelete="CASCADE"), unique=True)
    turn_id: Mapped[str | None] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(200))
    description: Mapped[str | None] = mapped_column(Text)
    agent_id: Mapped[str | None] = mapped_column(String(128))
    task_type: Mapped[str | None] = mapped_column(String(128))
    # running | paused | completed | failed | terminated
    status: Mapped[str] = mapped_column(String(16))
    state: Mapped[dict[str, Any]] = mapped_column(JSONB)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB)
    active_ms: Mapped[int] = mapped_column(BigInteger, server_default=sql("0"))
    running_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    paused_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )
    failure_reason: Mapped[str | None] = mapped_column(Text)
    # Runs of the turn after the first (config.retry).
    attempts: Mapped[int] = mapped_column(Integer, server_default=sql("0"))
    # The last automatic checkpoint's time (config.checkpoint_interval_seconds).
    last_checkpoint_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ExecutionCheckpoint(Base):
    """A point an execution can be rolled back to: its state document, and what the
    rollback restores — the turn's snapshot, the last message of the current
    conversation, the working memory and the workspace archive (None: none yet)."""

    __tablename__ = "execution_checkpoints"
    __table_args__ = (Index("ix_execution_checkpoints_execution", "execution_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    execution_id: Mapped[str] = mapped_column(ForeignKey("executions.id", ondelete="CASCADE"))
    label: Mapped[str | None] = mapped_column(String(200))
    state: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    turn_id: Mapped[str | None] = mapped_column(String(64))
    turn_state: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    last_message_id: Mapped[int | None] = mapped_column(BigInteger)
    working_memory: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    workspace_archive_id: Mapped[str | None] = mapped_column(String(64))
    automatic: Mapped[bool] = mapped_column(Boolean, server_default=sql("false"))


# -- completion webhooks ----------------------------------------------------------


class WebhookTenant(Base):
    """A tenant's webhook settings: the signing secret and the default subscription.

    The secret signs (HMAC) every delivery, so it must be read back: it is kept
    sealed by the Asset Directory's vault (``HOLDFAST_ASSET_ENCRYPTION_KEY``),
    never in clear, and returned once, when made (``POST /webhooks/secret``).
    """

    __tablename__ = "webhook_tenants"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    secret: Mapped[str | None] = mapped_column(Text)
    # The secret a rotation replaced (sealed too): messages are signed with both
    # for a while after ``rotated_at``, so receivers can switch without a gap.
    previous_secret: Mapped[str | None] = mapped_column(Text)
    rotated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # {url, events}: turns started without a ``webhook`` of their own use it.
    default_webhook: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class WebhookDelivery(Base):
    """The outbox: one webhook message, written in the transaction that records
    what it reports (a turn's end, a question), delivered by a gateway.

    Its id is the Standard Webhooks ``webhook-id`` (the same on every attempt
    and redelivery: receivers dedupe on it), made from what it reports, so
    writing it twice (a turn's end recorded again after a crash) changes
    nothing. ``status``: pending → delivering (a gateway holds it until
    ``next_attempt_at``) → delivered, or back to pending with a later
    ``next_attempt_at``, or failed after ``HOLDFAST_WEBHOOK_MAX_ATTEMPTS``.
    """

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_tenant", "tenant_id", "status", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    # The engine's task id; no foreign key: a delivery outlives a deleted task.
    task_id: Mapped[str] = mapped_column(String(128))
    turn_id: Mapped[str] = mapped_column(String(64))
    # completed | errored | cancelled | hitl_request | outcome_unknown
    event: Mapped[str] = mapped_column(String(32))
    url: Mapped[str] = mapped_column(Text)
    # What the writer knew (status, usage, last seq, the question); the body
    # sent is built from it on the first attempt and kept in ``body``, so every
    # attempt sends the same bytes.
    data: Mapped[dict[str, Any]] = mapped_column(JSONB)
    body: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, server_default=sql("0"))
    next_attempt_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
    last_error: Mapped[str | None] = mapped_column(Text)
    # The receiver's last HTTP status (None: no answer).
    last_status: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Schedule(Base):
    """A tenant's schedule: a message sent as a turn at each due time (``/schedules``).

    Exactly one of ``cron`` (in ``timezone``), ``interval_seconds`` (from
    ``anchor_at``) and ``at`` says when. ``next_due_at`` is the first due time
    not yet handled (None once a one-shot schedule has fired); the gateways'
    scheduler advances it with the row locked, and each due time it fires is a
    :class:`ScheduleRun` row, unique per schedule and due time.
    """

    __tablename__ = "schedules"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", name="uq_schedules_tenant_id_name"),
        # The scheduler's look-up: active schedules whose time has come.
        Index("ix_schedules_status_next_due", "status", "next_due_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(128))
    cron: Mapped[str | None] = mapped_column(String(200))
    interval_seconds: Mapped[int | None] = mapped_column(Integer)
    at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    timezone: Mapped[str] = mapped_column(String(64))
    # Interval schedules are due at anchor_at + k * interval_seconds.
    anchor_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The task each run is a turn of (its name); None: a new task per run.
    task_id: Mapped[str | None] = mapped_column(String(128))
    agent: Mapped[str | None] = mapped_column(String(128))
    message: Mapped[str] = mapped_column(Text)
    user_id: Mapped[str] = mapped_column(String(128), server_default="")
    # skip | enqueue | cancel_previous: what a due time does while the last run is active.
    overlap: Mapped[str] = mapped_column(String(16))
    # latest | all: which of the due times missed while no gateway ran are fired.
    catch_up: Mapped[str] = mapped_column(String(16))
    # JSON, not JSONB: JSONB reorders keys, and a model writes properties in the schema's order.
    output_schema: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    webhook: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # active | paused | completed (a one-shot schedule that fired)
    status: Mapped[str] = mapped_column(String(16))
    next_due_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now()
    )


class ScheduleRun(Base):
    """One due time of a schedule, handled once: the unique (schedule, due time)
    row is written in the transaction that starts its turn, so two gateways
    never both fire it.

    ``status``: ``started`` (its turn is ``turn_id`` of task ``task_id``, a
    name), ``waiting`` (overlap ``enqueue``, or ``cancel_previous`` on a given
    task: it starts once the previous run's turn has ended), ``skipped`` or
    ``failed`` (``reason`` says why).
    """

    __tablename__ = "schedule_runs"
    __table_args__ = (
        UniqueConstraint("schedule_id", "due_at", name="uq_schedule_runs_schedule_id_due_at"),
        Index("ix_schedule_runs_status", "status"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    schedule_id: Mapped[str] = mapped_column(ForeignKey("schedules.id", ondelete="CASCADE"))
    due_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    task_id: Mapped[str | None] = mapped_column(String(128))
    turn_id: Mapped[str | None] = mapped_column(String(64))
    # The scheduler's clock when the run's turn was written (its jitter: fired_at - due_at).
    fired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
