"""The context engine as the turn uses it: one request per model call, fitted.

:class:`ContextEngine` is built once per worker. For each model call the turn
asks it for a request (:meth:`ContextEngine.prepare`): it reads the task's
messages and its latest summary, the soul and the memories relevant to the
turn's message, assembles the sections (``assembly.py``) and, when the
estimate passes the threshold, compacts first (``compaction.py``) and
announces it with ``compaction_event``. The turn calls ``prepare`` again with
``harder=True`` when a provider still answers that the context is too long,
with the overflow (``budget.Overflow``): the window it implies is kept for
the model, so the task's later calls fit it from the start.

On a small window the fixed sections are trimmed first (``budget.trim``) and
each call's ``max_tokens`` is what the window leaves after the prompt, at most
the agent's or model's setting (``HOLDFAST_AGENT_MAX_OUTPUT_TOKENS``,
``HOLDFAST_MODEL_MAX_OUTPUT_TOKENS``, ``HOLDFAST_MAX_OUTPUT_TOKENS``).

It also keeps the task's working memory for the turn: loaded when a turn
starts (Redis, else what the last turn left in PostgreSQL), re-published
when a turn is taken over, changed by the ``working_memory`` tool.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from holdfast_shared.conversation import load_history
from holdfast_shared.events import CompactionEvent, WorkingMemoryUpdate, _Event
from holdfast_shared.jobs import ToolOutcome
from holdfast_shared.memory import Brain
from holdfast_shared.providers import ModelChoice, ProviderRegistry
from holdfast_shared.tools import ToolSpec
from holdfast_shared.working_memory import stored_working_memory
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.context import budget, compaction, tokens
from holdfast_loop_worker.context.assembly import (
    Assembled,
    Sections,
    Summary,
    assemble,
    turn_opener,
)
from holdfast_loop_worker.context.compaction import Summaries
from holdfast_loop_worker.context.memory import MemorySource
from holdfast_loop_worker.context.working_memory import WorkingMemoryStore, parse_change
from holdfast_loop_worker.turn_state import TurnState

log = logging.getLogger(__name__)

Emit = Callable[[_Event], Awaitable[None]]

# After a compaction the context is aimed at this share of the threshold (a
# harder one at half of it), so the next turns have room before the next one.
_AFTER_SHARE = 0.5
# The longest summary asked for.
_SUMMARY_MAX_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class ContextSettings:
    window: int | None  # HOLDFAST_CONTEXT_WINDOW; None: the model's known window
    threshold: float  # HOLDFAST_COMPACTION_THRESHOLD
    compaction_model: str | None  # HOLDFAST_COMPACTION_MODEL; None: the turn's model
    tool_result_chars: int  # HOLDFAST_TOOL_RESULT_CONTEXT_CHARS
    max_output_tokens: int = 4096  # HOLDFAST_MAX_OUTPUT_TOKENS
    # HOLDFAST_MODEL_MAX_OUTPUT_TOKENS ("provider:model" or "model") and
    # HOLDFAST_AGENT_MAX_OUTPUT_TOKENS, over max_output_tokens.
    model_max_output_tokens: Mapping[str, int] = field(default_factory=dict)
    agent_max_output_tokens: Mapping[str, int] = field(default_factory=dict)

    def output_limit(self, agent: str, provider: str, model: str) -> int:
        """The longest answer a call of ``agent`` on ``provider:model`` asks for."""
        for found in (
            self.agent_max_output_tokens.get(agent),
            self.model_max_output_tokens.get(f"{provider}:{model}"),
            self.model_max_output_tokens.get(model),
        ):
            if found is not None:
                return found
        return self.max_output_tokens


@dataclass(frozen=True, slots=True)
class TurnScope:
    """The turn a request is for."""

    tenant_id: str
    task_id: str
    turn_id: str
    # Messages of this turn from this position on were stored by a step that
    # was cut off; they are not part of the context.
    position: int
    # The end user whose brain the turn reads ("" is the tenant's).
    user_id: str = ""
    # The turn's agent (its output limit may be its own).
    agent: str = ""

    @property
    def brain(self) -> Brain:
        return Brain(self.tenant_id, self.user_id)


def unfit(
    settings: ContextSettings, model: str, system_prompt: str, tools: Sequence[ToolSpec]
) -> str | None:
    """Why ``model``'s window cannot hold even the trimmed fixed sections and a
    conversation, or None: a worker makes such a model unavailable (the
    gateway refuses it) instead of failing every turn."""
    window = tokens.context_window(model, settings.window)
    return budget.unfit_reason(model, window, settings.threshold, system_prompt, tools)


class ContextEngine:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        providers: ProviderRegistry,
        memory: MemorySource,
        working: WorkingMemoryStore,
        settings: ContextSettings,
        reads: async_sessionmaker[AsyncSession] | None = None,
    ) -> None:
        self.sessions = sessions
        # Look-ups: autocommit sessions (holdfast_shared.db.autocommit_session_factory).
        self.reads = reads or sessions
        self.providers = providers
        self.memory = memory
        self.working = working
        self.summaries = Summaries(sessions)
        self.settings = settings
        # Windows learned from providers' overflows, by model: smaller than
        # the configured or known one.
        self.learned_windows: dict[str, int] = {}
        # The largest prompt (estimated tokens) each model answered: no window
        # learned later is smaller, and a cut that size is no overflow.
        self.fitted_prompts: dict[str, int] = {}

    def window(self, model: str) -> int:
        known = tokens.context_window(model, self.settings.window)
        return min(known, self.learned_windows.get(model, known))

    def fitted(self, model: str) -> int:
        """The largest prompt ``model`` answered (estimated tokens; 0: none yet)."""
        return self.fitted_prompts.get(model, 0)

    def answered(self, model: str, prompt_tokens: int) -> None:
        """``model`` answered a prompt of ``prompt_tokens`` (estimated)."""
        self.fitted_prompts[model] = max(self.fitted(model), prompt_tokens)

    def learn(self, model: str, overflow: budget.Overflow) -> None:
        """Keep the window ``overflow`` implies for ``model``."""
        window = budget.learned_window(overflow, self.window(model), self.fitted(model))
        self._assume(
            model, window, f"a prompt of ~{overflow.prompt_tokens} tokens overflowed its window"
        )

    def learn_filled(self, model: str, tokens: int) -> None:
        """Keep ``tokens`` as ``model``'s window: a call's prompt and output
        filled it (the server stopped the answer there, short of its limit)."""
        self._assume(
            model,
            max(budget.MIN_WINDOW, tokens),
            f"an answer was stopped at ~{tokens} tokens of prompt and output",
        )

    def _assume(self, model: str, window: int, why: str) -> None:
        if window < self.window(model):
            log.warning("%s: %s: assuming a window of %d tokens", model, why, window)
            self.learned_windows[model] = window

    # -- a turn's working memory -----------------------------------------------
    async def begin_turn(
        self,
        task_id: str,
        state: TurnState,
        *,
        resumed: bool,
        stored: Mapping[str, Any] | None,
        calibration: float | None,
    ) -> None:
        """Put the task's working memory and calibration into ``state``.

        A turn resumed from a snapshot has both already; its working memory is
        published again, since the worker it came from may have died between
        changing it and publishing it.
        """
        if resumed:
            await self.working.replace(task_id, state.working_memory)
            return
        live = await self.working.load(task_id)
        if live is None and stored:
            live = stored_working_memory(stored)
            await self.working.replace(task_id, live)
        state.working_memory = live or {}
        state.calibration = tokens.sane_calibration(calibration)

    async def working_memory_call(
        self, task_id: str, state: TurnState, tool_input: Mapping[str, Any], emit: Emit
    ) -> ToolOutcome:
        """Run one ``working_memory`` tool call against the turn's state."""
        change = parse_change(tool_input, state.working_memory)
        if isinstance(change, str):
            return ToolOutcome(error=change)
        if change.value is None:
            existed = state.working_memory.pop(change.key, None) is not None
        else:
            existed = True
            state.working_memory[change.key] = change.value
        await self.working.apply(task_id, change)
        await emit(WorkingMemoryUpdate(key=change.key, value=change.value))
        if change.value is None and not existed:
            return ToolOutcome(output={"deleted": change.key, "note": "there was no such key"})
        if change.value is None:
            return ToolOutcome(output={"deleted": change.key})
        return ToolOutcome(output={"set": change.key})

    # -- the request of one model call -------------------------------------------
    async def prepare(
        self,
        scope: TurnScope,
        state: TurnState,
        choice: ModelChoice,
        *,
        system_prompt: str,
        tools: Sequence[ToolSpec],
        emit: Emit,
        harder: bool = False,
        brief_system_prompt: str | None = None,
        overflow: budget.Overflow | None = None,
    ) -> Assembled:
        """The request for the turn's next model call, compacted first when it
        would pass the threshold (or, ``harder``, in any case and further).
        ``brief_system_prompt`` (skills by name only) replaces the system
        prompt when the window is too small for it; ``overflow``: the last
        attempt's, whose window is learned (and ``harder`` implied)."""
        if overflow is not None:
            self.learn(choice.model, overflow)
            harder = True
        window = self.window(choice.model)
        sections = await self._sections(scope, state, system_prompt, tools)
        fixed_budget = budget.fixed_budget(window, self.settings.threshold)
        if tokens.calibrated(budget.fixed_tokens(sections), state.calibration) > fixed_budget:
            sections = budget.trim(
                sections,
                int(fixed_budget / max(state.calibration, 0.25)),
                brief_system_prompt,
            )
        summary = sections.summary
        assembled = self._assemble(sections, choice, scope, state)
        limit = window * self.settings.threshold
        before = tokens.calibrated(assembled.tokens, state.calibration)
        if before <= limit and not harder:
            return assembled
        target = limit * _AFTER_SHARE * (0.5 if harder else 1.0)
        summary_budget = min(_SUMMARY_MAX_TOKENS, window // 8)
        keep = (target - tokens.calibrated(assembled.fixed_tokens, state.calibration)) / max(
            state.calibration, 0.25
        ) - summary_budget
        cut = compaction.plan(
            assembled.view,
            keep_tokens=max(0, int(keep)),
            summarized_through=summary.last_message_id if summary else 0,
        )
        if cut is None:
            log.warning(
                "turn %s: the context (~%d tokens) is over the threshold but nothing can "
                "be summarized",
                scope.turn_id,
                before,
            )
            return assembled
        found = await self.summaries.find(scope.task_id, cut.last_message_id)
        if found is not None:
            # Made before this worker took the turn over: one summary per range.
            return self._assemble(replace(sections, summary=found), choice, scope, state)
        made = await self._summarize(state, choice, cut, summary, window, summary_budget)
        return await self._store_compacted(scope, state, choice, sections, cut, made, before, emit)

    async def _sections(
        self, scope: TurnScope, state: TurnState, system_prompt: str, tools: Sequence[ToolSpec]
    ) -> Sections:
        """What the request is made of, read for this call."""
        async with self.reads() as session:
            history = await load_history(
                session, scope.task_id, cutoff=(scope.turn_id, scope.position)
            )
            summary = await Summaries.latest(session, scope.task_id)
        # Memories are looked up by the message that opened the turn.
        opener = turn_opener(history, scope.turn_id)
        query = opener.text if opener is not None else ""
        # Retrieval first: it reads the soul too, and keeps both for the turn.
        retrieved = await self.memory.retrieve(scope.brain, scope.turn_id, query)
        soul = await self.memory.soul(scope.brain, scope.turn_id)
        return Sections(
            system_prompt=system_prompt,
            soul=soul,
            history=history,
            summary=summary,
            working_memory=state.working_memory,
            retrieved=retrieved,
            tools=tools,
        )

    async def _store_compacted(
        self,
        scope: TurnScope,
        state: TurnState,
        choice: ModelChoice,
        sections: Sections,
        cut: compaction.Plan,
        made: Summary,
        before: int,
        emit: Emit,
    ) -> Assembled:
        """The request with the new summary, stored (unless another worker's got
        there first: then with that one); a ``compaction`` event says so."""
        compacted = self._assemble(replace(sections, summary=made), choice, scope, state)
        after = tokens.calibrated(compacted.tokens, state.calibration)
        summary_tokens = tokens.calibrated(tokens.text_tokens(made.text), state.calibration)
        kept, created = await self.summaries.store(
            scope.task_id,
            made,
            summarized_messages=len(cut.messages),
            summary_tokens=summary_tokens,
            tokens_before=before,
            tokens_after=after,
            model=self._writer(choice).model,
        )
        if not created:
            return self._assemble(replace(sections, summary=kept), choice, scope, state)
        await emit(
            CompactionEvent(
                summarized_messages=len(cut.messages),
                summary_tokens=summary_tokens,
                tokens_before=before,
                tokens_after=after,
            )
        )
        return compacted

    def _assemble(
        self, sections: Sections, choice: ModelChoice, scope: TurnScope, state: TurnState
    ) -> Assembled:
        """The request, its ``max_tokens`` what the window leaves after the prompt."""
        assembled = assemble(
            sections,
            model=choice.model,
            provider=choice.provider.name,
            cache_key=f"{scope.tenant_id}:{scope.task_id}",
            tool_result_chars=self.settings.tool_result_chars,
        )
        wanted = self.settings.output_limit(scope.agent, choice.provider.name, choice.model)
        prompt = tokens.calibrated(assembled.tokens, state.calibration)
        limit = budget.output_tokens(self.window(choice.model), prompt, wanted)
        return replace(assembled, request=replace(assembled.request, max_tokens=limit))

    def _writer(self, choice: ModelChoice) -> ModelChoice:
        spec = self.settings.compaction_model
        return self.providers.resolve(spec) if spec else choice

    async def _summarize(
        self,
        state: TurnState,
        choice: ModelChoice,
        cut: compaction.Plan,
        previous: Summary | None,
        window: int,
        summary_budget: int,
    ) -> Summary:
        writer = self._writer(choice)
        made = await compaction.summarize(
            writer.provider,
            writer.model,
            previous.text if previous else None,
            cut.messages,
            window=min(window, self.window(writer.model)),
            max_tokens=summary_budget,
        )
        state.add_usage(made.usage)
        return Summary(cut.last_message_id, made.text)
