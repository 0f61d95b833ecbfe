"""Asking the user inside a turn: a permission prompt before a tool call, or the
model's own question (``ask_user``). Both park the turn while no answer is in
(``holdfast_loop_worker.hitl`` keeps the questions; ``parking.py`` parks)."""

from __future__ import annotations

from typing import Any, Literal

from holdfast_shared.errors import Parked
from holdfast_shared.events import HitlRequest, HitlResolved
from holdfast_shared.jobs import ToolOutcome

from holdfast_loop_worker.hitl import Answer
from holdfast_loop_worker.toolcalls import preview
from holdfast_loop_worker.turn.handle import AskingTurn
from holdfast_loop_worker.turn_state import PendingCall


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
    question, answer = await turn.read_question(call.hitl_request)
    if answer.status == "pending":
        announced = call.hitl_announced or question.request_id in turn.seen.hitl_requests
        call.hitl_announced = True
        if not announced:
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
    if answer.status != "expired" and question.request_id not in turn.seen.hitl_resolved:
        await turn.emit(HitlResolved(request_id=question.request_id, answer=answer.answer))
    return answer
