"""Asking the user inside a turn: a permission prompt before a tool call, the
model's own question (``ask_user``), or what became of an effectful call whose
outcome nobody knows (:func:`settle_unknown`). Each parks the turn while no
answer is in (``holdfast_loop_worker.hitl`` keeps the questions; ``parking.py``
parks). An MCP server's question during a call (:func:`elicit`) does not park:
the call is live on its runner, so the turn waits for the answer, as long as
the call's time allows."""

from __future__ import annotations

import time
from typing import Any, Literal, Protocol

from holdfast_shared.assets import ServerTool
from holdfast_shared.errors import Parked
from holdfast_shared.events import Event, HitlRequest, HitlResolved, ToolOutcomeUnknown
from holdfast_shared.jobs import (
    ElicitationAnswer,
    ToolElicitation,
    ToolOutcome,
    UnknownOutcome,
    idempotency_key,
)

from holdfast_loop_worker.hitl import Answer, Kind, Question
from holdfast_loop_worker.toolcalls import preview
from holdfast_loop_worker.turn.handle import AskingTurn, ToolTurn
from holdfast_loop_worker.turn_state import PendingCall

# The answers to an outcome_unknown request (the gateway's routes/hitl.py refuses others).
RETRY, SUCCEEDED, FAILED = "retry", "succeeded", "failed"


async def permission(turn: AskingTurn, call: PendingCall) -> ToolOutcome | None:
    """None when the user allowed the call; else the outcome the model sees."""
    answer = await ask(
        turn,
        call,
        "permission",
        f"Allow the agent to run {call.name}? {preview(call.input)}",
        {"tool": call.name, "tool_call_id": call.id, "input": call.input},
    )
    if answer.status == "expired":
        return ToolOutcome(error="permission request expired without an answer")
    if (answer.answer or "").strip().lower() != "yes":
        feedback = f" Feedback: {answer.feedback}" if answer.feedback else ""
        return ToolOutcome(error=f"the user denied permission to run {call.name}.{feedback}")
    return None


async def ask_user(turn: AskingTurn, call: PendingCall) -> ToolOutcome:
    """The model's own question (the ``ask_user`` tool): the answer is the result."""
    question = call.input.get("question")
    if not isinstance(question, str) or not question.strip():
        return ToolOutcome(error="ask_user needs a non-empty 'question' string")
    answer = await ask(turn, call, "question", question, None)
    if answer.status == "expired":
        return ToolOutcome(error="the user did not answer before the question expired")
    output: dict[str, Any] = {"answer": answer.answer}
    if answer.feedback:
        output["feedback"] = answer.feedback
    if answer.content_blocks:
        output["content_blocks"] = answer.content_blocks
    return ToolOutcome(output=output)


async def ask(
    turn: AskingTurn,
    call: PendingCall,
    kind: Literal["permission", "question"],
    text: str,
    tool_call: dict[str, Any] | None,
) -> Answer:
    """The user's answer; parks the turn (raises :class:`Parked`) while none is in."""
    if call.hitl_request is None:
        opened = await turn.open_question(kind, text, tool_call)
        call.hitl_request = opened.request_id
        await turn.snapshot("hitl")
    announced, call.hitl_announced = call.hitl_announced, True
    return await _answer_or_park(turn, call, call.hitl_request, announced)


async def settle_unknown(
    turn: ToolTurn, call: PendingCall, server_tool: ServerTool | None, outcome: ToolOutcome
) -> ToolOutcome:
    """The one result the model sees of an effectful call whose outcome is unknown.

    Never a silent retry: ``tool_outcome_unknown`` and a ``hitl_request`` of
    kind ``outcome_unknown`` go out and the turn parks until a person answers
    ``retry`` (the call runs again, same idempotency key, as its next attempt —
    which may itself end unknown and be asked about again), ``succeeded`` (the
    answer's ``feedback``, if any, is the result) or ``failed``.
    """
    while outcome.unknown is not None:
        unknown = outcome.unknown
        answer = await _settling(turn, call, unknown)
        if answer.status == "expired":
            return ToolOutcome(
                error=f"the outcome of this {call.name} call is unknown ({unknown.reason}): it "
                "may or may not have taken effect, and nobody settled it before the request "
                "expired. It was not run again."
            )
        choice = (answer.answer or "").strip().lower()
        if choice == RETRY:
            outcome = await turn.run_tool(call, server_tool, attempt=unknown.attempt + 1)
        elif choice == SUCCEEDED:
            output: dict[str, Any] = {"status": "succeeded", "settled_by": "a person"}
            if answer.feedback:
                output["result"] = answer.feedback
            if answer.content_blocks:
                output["content_blocks"] = answer.content_blocks
            return ToolOutcome(output=output)
        else:
            feedback = f" {answer.feedback}" if answer.feedback else ""
            return ToolOutcome(
                error=f"this {call.name} call did not take effect (a person settled its "
                f"unknown outcome as failed).{feedback}"
            )
    return outcome


async def _settling(turn: ToolTurn, call: PendingCall, unknown: UnknownOutcome) -> Answer:
    """The answer about ``unknown``'s attempt; parks (raises :class:`Parked`) while none is in."""
    if call.settle_request is not None:
        question, _ = await turn.read_question(call.settle_request)
        if (question.tool_call or {}).get("attempt") != unknown.attempt:
            # A retry's attempt was lost as well: that is a new question.
            call.settle_request, call.settle_announced = None, False
    key = idempotency_key(turn.job.tenant_id, turn.job.task_id, turn.job.turn_id, call.id)
    if call.settle_request is None:
        opened = await turn.open_question(
            "outcome_unknown",
            f"Nobody knows whether {call.name} took effect ({unknown.reason}); it was not "
            f"run again. {preview(call.input)} Answer retry, succeeded or failed.",
            {
                "tool": call.name,
                "tool_call_id": call.id,
                "input": call.input,
                "idempotency_key": key,
                "attempt": unknown.attempt,
                "sent_at": unknown.sent_at,
                "runner_lost_at": unknown.runner_lost_at,
            },
        )
        call.settle_request = opened.request_id
        await turn.snapshot("hitl")
    announced, call.settle_announced = call.settle_announced, True
    unknown_event = ToolOutcomeUnknown(
        tool_call_id=call.id,
        tool=call.name,
        input=call.input,
        idempotency_key=key,
        attempt=unknown.attempt,
        reason=unknown.reason,
        sent_at=unknown.sent_at,
        runner_lost_at=unknown.runner_lost_at,
    )
    return await _answer_or_park(turn, call, call.settle_request, announced, unknown_event)


class ElicitingTurn(AskingTurn, Protocol):
    """What :func:`elicit` needs of the turn (live.py)."""

    async def open_question(
        self,
        kind: Kind,
        text: str,
        tool_call: dict[str, Any] | None,
        *,
        ttl_seconds: float | None = None,
    ) -> Question: ...
    async def answer_arrived(self, request_id: str, within: float) -> None: ...
    async def end_question(self, request_id: str) -> bool: ...
    async def answer_server(self, reply_key: str, answer: ElicitationAnswer) -> None: ...


async def elicit(turn: ElicitingTurn, call: PendingCall, asked: ToolElicitation) -> None:
    """Ask the user a running call's server's question (a ``hitl_request`` of
    kind ``elicitation`` with its ``requested_schema``) and send the answer back
    to the server. Nobody answering within ``asked.wait_seconds`` is ``cancel``
    (the request ends as expired). The gateway checks an accepted answer
    against the schema, so what comes back is the server's to take."""
    tool_call = {
        "tool": call.name,
        "tool_call_id": call.id,
        "requested_schema": asked.requested_schema,
    }
    question = await turn.open_question(
        "elicitation", asked.message, tool_call, ttl_seconds=asked.wait_seconds
    )
    await turn.emit(
        HitlRequest(
            request_id=question.request_id,
            kind="elicitation",
            question=question.question,
            tool_call=tool_call,
            requested_schema=asked.requested_schema,
            expires_at=question.expires_at_ms,
        )
    )
    deadline = time.monotonic() + asked.wait_seconds
    while True:
        _, answer = await turn.read_question(question.request_id)
        if answer.status != "pending":
            break
        left = deadline - time.monotonic()
        if left <= 0:
            if await turn.end_question(question.request_id):
                answer = Answer("expired")
                break
            continue  # answered just now: read it
        await turn.answer_arrived(question.request_id, within=left)
    if answer.status == "answered":
        action = (answer.answer or "").strip().lower()
        await turn.emit(HitlResolved(request_id=question.request_id, answer=action))
        reply = ElicitationAnswer.model_validate(
            {"action": action, "content": answer.content if action == "accept" else None}
        )
    else:
        reply = ElicitationAnswer(action="cancel")
    await turn.answer_server(asked.reply_key, reply)


async def _answer_or_park(
    turn: AskingTurn, call: PendingCall, request_id: str, announced: bool, *first: Event
) -> Answer:
    """The answer to ``request_id``; while none is in, the request is announced
    (after ``first``) unless it was already, and the turn parks (:class:`Parked`)."""
    question, answer = await turn.read_question(request_id)
    if answer.status == "pending":
        if not announced and question.request_id not in turn.seen.hitl_requests:
            for event in first:
                await turn.emit(event)
            await turn.emit(
                HitlRequest(
                    request_id=question.request_id,
                    kind=question.kind,
                    question=question.question,
                    tool_call=question.tool_call,
                    expires_at=question.expires_at_ms,
                )
            )
        raise Parked(question.request_id)
    if answer.status == "expired":
        return answer
    if question.request_id not in turn.seen.hitl_resolved | set(call.resolved):
        await turn.emit(HitlResolved(request_id=question.request_id, answer=answer.answer))
    if question.request_id not in call.resolved:
        call.resolved.append(question.request_id)
    return answer
