"""Questions to the user that park the turn instead of holding a worker.

Asking stores a ``hitl_requests`` row (listed by ``GET /hitl/pending``) and
returns at once: the loop then snapshots the turn and releases its worker.
``POST /hitl/respond`` records the answer and queues a resume job, and
whichever worker takes it reads the answer back with :meth:`HumanChannel.read`
— minutes or days later, after any restart. A request nobody answers
expires after ``HOLDFAST_CHANNEL_STATE_TTL_HITL``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from holdfast_shared.db.models import HitlRequestRecord
from holdfast_shared.ids import new_id
from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.webhook_outbox import question_insert

# permission: before a tool call; question: the model's own (ask_user);
# outcome_unknown: an effectful call whose outcome nobody knows (retry/succeeded/failed);
# elicitation: an MCP server's question during a call (the turn waits, not parked).
Kind = Literal["permission", "question", "outcome_unknown", "elicitation"]


@dataclass(frozen=True, slots=True)
class Question:
    request_id: str
    kind: Kind
    question: str
    tool_call: dict[str, Any] | None
    expires_at_ms: int


@dataclass(frozen=True, slots=True)
class Answer:
    # pending | answered | expired
    status: str
    answer: str | None = None
    feedback: str | None = None
    content_blocks: list[dict[str, Any]] | None = None
    # An elicitation's accepted form data.
    content: dict[str, Any] | None = None


class HumanChannel:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], *, ttl_seconds: int) -> None:
        self.sessions = sessions
        self.ttl = timedelta(seconds=ttl_seconds)

    async def open(
        self,
        *,
        tenant_id: str,
        task_id: str,
        turn_id: str,
        kind: Kind,
        question: str,
        tool_call: dict[str, Any] | None = None,
        ttl_seconds: float | None = None,
    ) -> Question:
        """``ttl_seconds``: this request's own bound, under the channel's."""
        request_id = new_id("hitl")
        ttl = self.ttl if ttl_seconds is None else min(self.ttl, timedelta(seconds=ttl_seconds))
        expires = datetime.now(UTC) + ttl
        async with self.sessions.begin() as session:
            session.add(
                HitlRequestRecord(
                    request_id=request_id,
                    tenant_id=tenant_id,
                    task_id=task_id,
                    turn_id=turn_id,
                    kind=kind,
                    question=question,
                    tool_call=tool_call,
                    expires_at=expires,
                )
            )
            # The subscriber hears of the question with it, or not at all.
            await session.execute(
                question_insert(
                    tenant_id=tenant_id,
                    task_id=task_id,
                    turn_id=turn_id,
                    request_id=request_id,
                    kind=kind,
                    question=question,
                    tool_call=tool_call,
                    expires_at_ms=int(expires.timestamp() * 1000),
                )
            )
        return Question(request_id, kind, question, tool_call, int(expires.timestamp() * 1000))

    async def read(self, request_id: str) -> tuple[Question, Answer]:
        """The request and its answer; a pending request past its TTL becomes expired."""
        async with self.sessions() as session:
            row = await session.get(HitlRequestRecord, request_id)
        if row is None:
            raise LookupError(f"no HITL request {request_id}")
        question = Question(
            row.request_id,
            row.kind,  # type: ignore[arg-type]
            row.question,
            row.tool_call,
            int(row.expires_at.timestamp() * 1000),
        )
        if row.status == "pending" and row.expires_at <= datetime.now(UTC):
            async with self.sessions.begin() as session:
                await session.execute(
                    update(HitlRequestRecord)
                    .where(
                        HitlRequestRecord.request_id == request_id,
                        HitlRequestRecord.status == "pending",
                    )
                    .values(status="expired")
                )
            return question, Answer("expired")
        stored = row.answer_content or {}
        return question, Answer(
            row.status, row.answer, row.feedback, stored.get("blocks"), stored.get("content")
        )

    async def expire(self, request_id: str) -> bool:
        """End a pending request now (its asker stopped waiting); False if it was answered."""
        async with self.sessions.begin() as session:
            ended = await session.scalar(
                update(HitlRequestRecord)
                .where(
                    HitlRequestRecord.request_id == request_id,
                    HitlRequestRecord.status == "pending",
                )
                .values(status="expired")
                .returning(HitlRequestRecord.request_id)
            )
        return ended is not None

    async def expire_overdue(self, limit: int = 100) -> list[tuple[str, str, str]]:
        """Mark pending requests past their TTL expired; their (tenant, task, turn)
        to resume (an elicitation's turn never parked for it: not those)."""
        async with self.sessions.begin() as session:
            rows = (
                await session.execute(
                    update(HitlRequestRecord)
                    .where(
                        HitlRequestRecord.request_id.in_(
                            select(HitlRequestRecord.request_id)
                            .where(
                                HitlRequestRecord.status == "pending",
                                HitlRequestRecord.expires_at <= datetime.now(UTC),
                                # Its turn is not parked: it ends the request itself
                                # (or died with it), and has nothing to resume.
                                HitlRequestRecord.kind != "elicitation",
                            )
                            .limit(limit)
                        )
                    )
                    .values(status="expired")
                    .returning(
                        HitlRequestRecord.tenant_id,
                        HitlRequestRecord.task_id,
                        HitlRequestRecord.turn_id,
                    )
                )
            ).all()
        return [(r[0], r[1], r[2]) for r in rows]
