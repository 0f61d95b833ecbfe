"""The turn's side of an MCP server's question (turn/hitl.py ``elicit``): a
``hitl_request`` of kind ``elicitation`` with the server's schema, a wait that
does not park, the person's action (with content only for accept) sent back to
the runner, and ``cancel`` when nobody answers within the call's bound."""

from __future__ import annotations

from typing import Any, cast

from holdfast_loop_worker.hitl import Answer, Kind, Question
from holdfast_loop_worker.turn.hitl import ElicitingTurn, elicit
from holdfast_loop_worker.turn_state import PendingCall
from holdfast_shared.events import HitlRequest, HitlResolved
from holdfast_shared.jobs import ElicitationAnswer, ToolElicitation

_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


class _Turn:
    """The collaborators ``elicit`` uses, in memory: ``answers`` are what
    reading the request gives, one per read (the last repeats)."""

    def __init__(self, *answers: Answer, expires: bool = True) -> None:
        self.answers = list(answers)
        self.expires = expires
        self.events: list[Any] = []
        self.sent: list[tuple[str, ElicitationAnswer]] = []
        self.opened: list[tuple[Kind, str, dict[str, Any] | None, float | None]] = []
        self.waits = 0
        self.ended = False

    async def emit(self, event: Any) -> None:
        self.events.append(event)

    async def open_question(
        self,
        kind: Kind,
        text: str,
        tool_call: dict[str, Any] | None,
        *,
        ttl_seconds: float | None = None,
    ) -> Question:
        self.opened.append((kind, text, tool_call, ttl_seconds))
        return Question("hitl_1", kind, text, tool_call, 123)

    async def read_question(self, request_id: str) -> tuple[Question, Answer]:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return Question(request_id, "elicitation", "q", None, 123), answer

    async def answer_arrived(self, request_id: str, within: float) -> None:
        self.waits += 1

    async def end_question(self, request_id: str) -> bool:
        self.ended = True
        return self.expires

    async def answer_server(self, reply_key: str, answer: ElicitationAnswer) -> None:
        self.sent.append((reply_key, answer))


def _asked(wait: float = 30.0) -> ToolElicitation:
    return ToolElicitation(
        message="Your name?", requested_schema=_SCHEMA, reply_key="reply", wait_seconds=wait
    )


async def _elicit(turn: _Turn, asked: ToolElicitation) -> None:
    call = PendingCall(id="call_1", name="srv__ask", input={})
    await elicit(cast(ElicitingTurn, turn), call, asked)


async def test_an_accepted_answer_goes_back_with_its_content() -> None:
    turn = _Turn(
        Answer("pending"),
        Answer("pending"),
        Answer("answered", "Accept", content={"name": "Ada"}),
    )
    await _elicit(turn, _asked())
    ((kind, text, tool_call, ttl),) = turn.opened
    assert (kind, text, ttl) == ("elicitation", "Your name?", 30.0)
    assert tool_call == {"tool": "srv__ask", "tool_call_id": "call_1", "requested_schema": _SCHEMA}
    request, resolved = turn.events
    assert isinstance(request, HitlRequest) and request.kind == "elicitation"
    assert request.requested_schema == _SCHEMA and request.expires_at == 123
    assert isinstance(resolved, HitlResolved) and resolved.answer == "accept"
    assert turn.waits == 2 and not turn.ended
    assert turn.sent == [("reply", ElicitationAnswer(action="accept", content={"name": "Ada"}))]


async def test_a_declined_answer_carries_no_content() -> None:
    turn = _Turn(Answer("answered", "decline", content={"name": "stray"}))
    await _elicit(turn, _asked())
    assert turn.sent == [("reply", ElicitationAnswer(action="decline"))]


async def test_nobody_answering_in_time_is_cancel_and_the_request_ends() -> None:
    turn = _Turn(Answer("pending"))
    await _elicit(turn, _asked(wait=0.0))
    assert turn.ended and turn.waits == 0
    assert [type(e) for e in turn.events] == [HitlRequest]  # never resolved
    assert turn.sent == [("reply", ElicitationAnswer(action="cancel"))]


async def test_an_answer_that_comes_as_the_wait_ends_is_taken() -> None:
    # The request could not be ended: it was answered just then, and that answer counts.
    turn = _Turn(Answer("pending"), Answer("answered", "cancel"), expires=False)
    await _elicit(turn, _asked(wait=0.0))
    assert turn.ended
    assert turn.sent == [("reply", ElicitationAnswer(action="cancel"))]
    assert isinstance(turn.events[-1], HitlResolved) and turn.events[-1].answer == "cancel"
