"""Asking the user: a ``hitl_request`` event, a stored request, and the wait for the answer.

The request is a ``hitl_requests`` row (listed by ``GET /hitl/pending``,
answered by ``POST /hitl/respond``); the gateway sends the answer to this
worker's inbox. While waiting, the turn holds its task's lock, so a new
message for the task gets 409 ``HITL_REQUIRED``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from holdfast_shared.db.models import HitlRequestRecord
from holdfast_shared.events import HitlRequest, HitlResolved
from holdfast_shared.ids import new_id
from holdfast_shared.jobs import InboxMessage
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.emitter import Emitter
from holdfast_loop_worker.inbox import Inbox


@dataclass(frozen=True, slots=True)
class Answer:
    request_id: str
    answer: str | None
    feedback: str | None
    expired: bool = False


class HumanChannel:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        inbox: Inbox,
        *,
        ttl_seconds: int,
    ) -> None:
        self.sessions = sessions
        self.inbox = inbox
        self.ttl_seconds = ttl_seconds

    async def ask(
        self,
        emitter: Emitter,
        *,
        tenant_id: str,
        task_id: str,
        turn_id: str,
        kind: Literal["permission", "question"],
        question: str,
        tool_call: dict[str, Any] | None = None,
    ) -> Answer:
        """Ask and wait; an unanswered request expires after the HITL TTL."""
        request_id = new_id("hitl")
        expires = datetime.now(UTC) + timedelta(seconds=self.ttl_seconds)
        answer = self.inbox.expect(request_id)
        try:
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
                        reply_to=self.inbox.stream,
                        expires_at=expires,
                    )
                )
            await emitter.emit(
                HitlRequest(
                    request_id=request_id,
                    kind=kind,
                    question=question,
                    tool_call=tool_call,
                    expires_at=int(expires.timestamp() * 1000),
                )
            )
            await emitter.drain()
            try:
                message = await _wait(answer, expires)
            except TimeoutError:
                await self._expire(request_id)
                return Answer(request_id, None, None, expired=True)
        finally:
            self.inbox.forget(request_id)
        payload = message.payload
        await emitter.emit(HitlResolved(request_id=request_id, answer=payload.get("answer")))
        return Answer(request_id, payload.get("answer"), payload.get("feedback"))

    async def _expire(self, request_id: str) -> None:
        async with self.sessions.begin() as session:
            await session.execute(
                update(HitlRequestRecord)
                .where(
                    HitlRequestRecord.request_id == request_id,
                    HitlRequestRecord.status == "pending",
                )
                .values(status="expired")
            )


async def _wait(future: asyncio.Future[InboxMessage], expires: datetime) -> InboxMessage:
    remaining = max(0.0, expires.timestamp() - time.time())
    async with asyncio.timeout(remaining):
        return await future
