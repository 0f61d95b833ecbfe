"""``holdfast chat``: talk to an agent from the terminal, on the Python SDK.

Text streams as it comes, thinking dimmed, tool calls and their results one
line each; a permission prompt or a question is asked inline and answered
through the HITL API. The SDK resumes a dropped stream by itself, so a
flaky connection shows nothing but a pause. The header names the model that
will answer before anything is sent: the agent's preferred one where it is
served, else the default the live loop-workers report (``GET /health``'s
``subsystems.models``); each
turn's ``usage`` event names the one that did, and a line says so whenever it
changes (with what the built-in ``scripted`` model does, as it answers when no
provider key is set). With ``--task`` it continues a task, and first follows a
turn of it that is still running (answering the question it waits on, if any).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from holdfast_client import (
    Client,
    CompactionEvent,
    ContentBlockStart,
    ContentBlockStop,
    ErrorEvent,
    Event,
    HitlRequest,
    HitlResolved,
    HoldfastError,
    SubagentCompleted,
    SubagentStarted,
    TextDelta,
    ThinkingDelta,
    ThreadLifecycle,
    ToolCall,
    ToolResult,
    TurnResumed,
    TurnStream,
    Usage,
    UserMessage,
    WorkingMemoryUpdate,
)
from holdfast_shared.modelspec import parse_model_spec
from rich.console import Console
from rich.text import Text

# Tool inputs and outputs are shown on one line, cut to this many characters.
_COMPACT = 120
_BUSY = frozenset({"TURN_IN_PROGRESS", "HITL_REQUIRED"})
HELP = (
    "Type a message and press Enter. /task shows the task id, /model the model; "
    "/exit or Ctrl-D quits."
)
SCRIPTED_NOTE = (
    "the built-in scripted model (no provider key set): it echoes each message and follows "
    "`/script {...}` messages (README: Using it); for a real model set a provider key, "
    "e.g. ANTHROPIC_API_KEY, before `holdfast up`"
)


def _compact(value: Any, limit: int = _COMPACT) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Chat:
    """One chat session: a task (new until the first turn names it) and its display."""

    def __init__(
        self,
        client: Client,
        console: Console,
        *,
        task_id: str | None = None,
        agent: str | None = None,
        ask: Callable[[str], str] = input,
    ) -> None:
        self.client = client
        self.console = console
        self.task_id = task_id
        self.agent = agent
        self._ask = ask
        # Whether the cursor is mid-line (text printed without a newline yet).
        self._open_line = False
        # The model the server last said answered (a usage event's provider:model).
        self.model: str | None = None

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> int:
        where = f"task [bold]{self.task_id}[/]" if self.task_id else "a new task"
        agent = f" with agent [bold]{self.agent}[/]" if self.agent else ""
        self.console.print(f"[bold]holdfast chat[/]: {where}{agent}. [dim]{HELP}[/]")
        self.model = self._expected_model()
        if self.model is not None:
            self._line(self._model_line(self.model))
        else:
            self.console.print(
                f"[bold]model[/]: the engine's choice for {self.agent or 'the general agent'}, "
                "named with the first reply. [dim]/model shows it.[/]"
            )
        if self.task_id:
            self._resume_waiting_turn()
        while True:
            try:
                message = self._ask("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                self.console.print()
                return 0
            if not message:
                continue
            if message in ("/exit", "/quit"):
                return 0
            if message == "/task":
                self.console.print(self.task_id or "(no task yet: send a message)")
                continue
            if message == "/model":
                self.console.print(self.model or "(not known yet: send a message)")
                continue
            if message == "/help":
                self.console.print(HELP)
                continue
            self.send(message)

    def _expected_model(self) -> str | None:
        """The model a turn of this chat should run on, if the server can say: the
        agent's preferred one when a live loop-worker serves its provider, else the
        loop-workers' default when they agree on one. (A gateway's
        HOLDFAST_AGENT_MODELS can still pick another; the first reply then says so.)"""
        try:
            subsystems = self.client.health().get("subsystems") or {}
            preferred = self.client.get_agent(self.agent).get("model") if self.agent else None
        except HoldfastError:
            return None  # named with the first reply, as before
        models = subsystems.get("models") if isinstance(subsystems, dict) else None
        if not isinstance(models, dict):
            return None
        providers, defaults = models.get("providers") or [], models.get("default") or []
        if isinstance(preferred, str):
            with contextlib.suppress(ValueError):
                spec = parse_model_spec(preferred)
                if spec.provider in providers:
                    return str(spec)
        if len(defaults) == 1 and isinstance(defaults[0], str):
            return str(defaults[0])
        return None

    def send(self, message: str) -> None:
        """Send one message and show its turn to the end."""
        turn = self.client.stream(message, task_id=self.task_id, agent=self.agent)
        try:
            self._show(turn)
        except HoldfastError as error:
            if error.code in _BUSY and isinstance(error.details.get("turn_id"), str):
                self._say("yellow", f"the task is busy ({error.message}); following that turn")
                assert self.task_id is not None
                self._follow(self.task_id, error.details["turn_id"])
            else:
                self._error(error)

    def _resume_waiting_turn(self) -> None:
        """A continued task may be in a turn, even waiting for an answer: follow it."""
        assert self.task_id is not None
        try:
            pending = self.client.pending(self.task_id)
        except HoldfastError as error:
            self._error(error)
            return
        if pending:
            self._say("yellow", "this task waits for an answer; its turn so far:")
            self._follow(self.task_id, pending[0].turn_id)

    def _follow(self, task_id: str, turn_id: str) -> None:
        try:
            self._show(self.client.follow(task_id, turn_id))
        except HoldfastError as error:
            self._error(error)

    def _show(self, turn: TurnStream) -> None:
        try:
            for event in turn:
                if turn.task_id and turn.task_id != self.task_id:
                    self.task_id = turn.task_id
                self.render(event, turn)
        except KeyboardInterrupt:
            self._end_line()
            if self.task_id:
                self._say("yellow", "cancelling the turn…")
                try:
                    self.client.cancel(self.task_id)
                except HoldfastError as error:
                    self._error(error)
        finally:
            turn.close()
            self._end_line()

    # -- one event ------------------------------------------------------------------------

    def render(self, event: Event, turn: TurnStream) -> None:
        origin = event.subagent
        if isinstance(event, SubagentStarted) and origin is not None:
            self._line(
                Text.assemble(
                    ("⇢ ", "magenta"),
                    (f"{origin.agent} ({origin.task_id})", "bold magenta"),
                    " ",
                    (_compact(event.brief), "magenta"),
                )
            )
            return
        if isinstance(event, SubagentCompleted) and origin is not None:
            self._line(Text(f"⇠ {origin.agent}: {event.status}", style="magenta"))
            return
        if origin is not None and not isinstance(event, HitlRequest):
            # A subagent's own work: its task shows it (holdfast chat --task <child>).
            return
        if isinstance(event, TextDelta):
            self._write(Text(event.text))
        elif isinstance(event, ThinkingDelta):
            self._write(Text(event.text, style="dim italic"))
        elif isinstance(event, ContentBlockStart) and event.block_type != "tool_use":
            self._end_line()
        elif isinstance(event, ContentBlockStop):
            self._end_line()
        elif isinstance(event, ToolCall):
            self._line(
                Text.assemble(
                    ("⚙ ", "cyan"), (event.tool, "bold cyan"), " ", (_compact(event.input), "cyan")
                )
            )
        elif isinstance(event, ToolResult):
            if event.error:
                self._line(Text(f"  ↳ error: {_compact(event.error)}", style="red"))
            else:
                self._line(Text(f"  ↳ {_compact(event.output)}", style="green"))
        elif isinstance(event, HitlRequest):
            self._answer(event, turn)
        elif isinstance(event, HitlResolved):
            self._line(Text(f"  ↳ answered: {event.answer or ''}", style="dim"))
        elif isinstance(event, TurnResumed):
            note = f"↻ the turn resumed ({event.reason})"
            if event.discard_from_seq is not None:
                note += "; the cut-off output above is discarded and comes again"
            self._line(Text(note, style="yellow"))
        elif isinstance(event, UserMessage):
            self._line(Text(f"↪ joined the turn: {_compact(event.text)}", style="dim"))
        elif isinstance(event, WorkingMemoryUpdate):
            value = "(deleted)" if event.value is None else _compact(event.value, 60)
            self._line(Text(f"✎ {event.key} = {value}", style="dim"))
        elif isinstance(event, CompactionEvent):
            self._line(Text(f"… {event.summarized_messages} messages summarised", style="dim"))
        elif isinstance(event, Usage) and event.model and event.model != self.model:
            self.model = event.model
            self._line(self._model_line(event.model))
        elif isinstance(event, ErrorEvent):
            self._line(Text(f"error {event.error}: {event.message}", style="bold red"))
        elif isinstance(event, ThreadLifecycle) and event.phase == "errored":
            self._line(Text(f"the turn failed ({event.stop_reason or 'error'})", style="red"))

    def _answer(self, request: HitlRequest, turn: TurnStream) -> None:
        task_id = turn.task_id or self.task_id
        assert task_id is not None
        self._end_line()
        if request.kind == "permission":
            call = request.tool_call or {}
            what = f"{call.get('tool', '?')} {_compact(call.get('input', {}), 80)}"
            self.console.print(Text.assemble(("? ", "bold yellow"), ("allow ", "yellow"), what))
            reply = self._prompt("allow? [y/N] ").lower()
            answer = "yes" if reply in ("y", "yes") else "no"
            feedback = None if answer == "yes" else (self._prompt("why not? (optional) ") or None)
        else:
            self.console.print(Text.assemble(("? ", "bold yellow"), request.question))
            answer = ""
            while not answer:
                answer = self._prompt("answer> ")
            feedback = None
        try:
            self.client.answer(task_id, answer, request_id=request.request_id, feedback=feedback)
        except HoldfastError as error:
            # Answered elsewhere first, or expired: the stream says what happened next.
            self._error(error)

    # -- output ---------------------------------------------------------------------------

    def _prompt(self, prompt: str) -> str:
        try:
            return self._ask(prompt).strip()
        except EOFError:
            return ""

    def _write(self, text: Text) -> None:
        self.console.print(text, end="", soft_wrap=True)
        self._open_line = True

    def _line(self, text: Text) -> None:
        self._end_line()
        self.console.print(text, soft_wrap=True)

    def _end_line(self) -> None:
        if self._open_line:
            self.console.print()
            self._open_line = False

    @staticmethod
    def _model_line(model: str) -> Text:
        note = f" — {SCRIPTED_NOTE}" if model.startswith("scripted:") else ""
        return Text.assemble(("model: ", "bold"), model, (note, "dim"))

    def _say(self, style: str, message: str) -> None:
        self._line(Text(message, style=style))

    def _error(self, error: HoldfastError) -> None:
        self._line(Text(f"error {error.code}: {error.message}", style="bold red"))


def run_chat(
    *, url: str | None, key: str | None, task_id: str | None, agent: str | None, console: Console
) -> int:
    """Run a chat session on the keyboard; the exit code."""
    try:
        client = Client(url, key)
    except HoldfastError as error:
        console.print(f"[bold red]error:[/] {error.message}")
        return 2
    with client:
        return Chat(client, console, task_id=task_id, agent=agent).run()
