"""A turn's skills: what the model is told of them, and the ``skill`` tool.

Read once when the turn starts (or resumes) from the agent's ``skills``
(``holdfast_shared.skills``: built-ins and the tenant's own; a name the
tenant no longer has is left out). They shape the turn in three places:

* the system prompt ends with a Skills section — each skill's name and
  description, nothing else (progressive disclosure), the same on every
  call of the task so prompt caches hold;
* the ``skill`` tool: without ``input`` it returns the skill's instructions
  and its file list; with ``input``, a prompt-only skill (no files) does the
  work in a sub-call to the turn's model (``purpose="skill"``, nothing
  streamed to the client) whose answer is the tool's result, its usage
  counted in the turn's;
* the skills with files are named on the turn's sandboxed tool calls
  (:attr:`TurnSkills.mounted`): the tool-runner mounts each read-only at
  ``.skills/<name>/`` in the workspace.

A tool call's outcome is stored with the turn's state like any other, so a
resumed turn does not make a finished sub-call again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from holdfast_shared import skills as catalogue
from holdfast_shared.agents import AgentDefinition
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.events import USAGE_COUNTS
from holdfast_shared.jobs import ToolOutcome
from holdfast_shared.providers import ModelChoice, ProviderError, TextChunk, UsageReport
from holdfast_shared.providers.base import ModelRequest
from holdfast_shared.providers.calls import stream_with_retries
from holdfast_shared.skills import SkillSummary
from holdfast_shared.tools import BASH, LIST_DIR, READ_FILE
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

# The tools through which the model sees the workspace, and so a skill's files.
_SANDBOX_TOOLS = frozenset({BASH.name, READ_FILE.name, LIST_DIR.name})
_MAX_INPUT_CHARS = 200_000
SUBCALL_MAX_TOKENS = 4096


@dataclass(frozen=True)
class TurnSkills:
    """The skills of one turn's agent, as the tenant has them."""

    tenant_id: str = ""
    skills: tuple[SkillSummary, ...] = ()
    # Whether the agent has tools that see the workspace (and so the files).
    sandbox: bool = False
    _by_name: dict[str, SkillSummary] = field(default_factory=dict, repr=False)

    @classmethod
    async def load(
        cls,
        sessions: async_sessionmaker[AsyncSession],
        tenant_id: str,
        agent: AgentDefinition,
        *,
        tools: bool,
    ) -> TurnSkills:
        """The agent's skills the tenant has, in the agent's order. ``tools``:
        whether the engine runs tools at all (without, no skill tool either)."""
        if not agent.skills or not tools:
            return cls(tenant_id)
        async with sessions() as session:
            found = await catalogue.summaries(session, tenant_id, agent.skills)
        return cls(
            tenant_id,
            tuple(found),
            sandbox=bool(_SANDBOX_TOOLS & set(agent.tools)),
            _by_name={skill.name: skill for skill in found},
        )

    def system_prompt(self, base: str, *, brief: bool = False) -> str:
        """The agent's system prompt with the Skills section (if any) after it;
        ``brief``: the skills by name only (for a small context window)."""
        if brief and self.skills:
            names = ", ".join(skill.name for skill in self.skills)
            section = (
                "# Skills\n\nCall the `skill` tool with a skill's name to read its "
                f"instructions before work it fits. Your skills: {names}."
            )
        else:
            section = catalogue.skills_section(self.skills, sandbox=self.sandbox)
        return f"{base}\n\n{section}" if section else base

    @property
    def mounted(self) -> tuple[str, ...]:
        """The skills the sandbox mounts at ``.skills/<name>/``: those with files."""
        if not self.sandbox:
            return ()
        return tuple(skill.name for skill in self.skills if skill.files)

    async def call(
        self,
        sessions: async_sessionmaker[AsyncSession],
        tool_input: dict[str, Any],
        choice: ModelChoice,
        *,
        attempts: int,
        usage: dict[str, int],
    ) -> ToolOutcome:
        """The ``skill`` tool. ``usage`` gets a sub-call's token counts added."""
        name = tool_input.get("name")
        given = tool_input.get("input")
        if not isinstance(name, str) or not name:
            return ToolOutcome(error="skill needs a 'name': one of your skills")
        if given is not None and not isinstance(given, str):
            return ToolOutcome(error="skill's 'input' is a string")
        summary = self._by_name.get(name)
        if summary is None:
            return ToolOutcome(error=f"unknown skill {name!r}; {self._known()}")
        async with sessions() as session:
            skill = await catalogue.find_skill(session, self.tenant_id, name)
        if skill is None:  # deleted since the turn started
            return ToolOutcome(error=f"skill {name!r} is no longer there; {self._known()}")
        if given is None or not given.strip() or skill.has_files:
            return ToolOutcome(output=self._loaded(skill, given))
        if len(given) > _MAX_INPUT_CHARS:
            return ToolOutcome(error=f"skill's 'input' has at most {_MAX_INPUT_CHARS} characters")
        return await _subcall(choice, skill, given, attempts=attempts, usage=usage)

    def _known(self) -> str:
        names = ", ".join(skill.name for skill in self.skills)
        return f"your skills are: {names}" if names else "you have no skills"

    def _loaded(self, skill: catalogue.Skill, given: str | None) -> dict[str, Any]:
        output: dict[str, Any] = {
            "skill": skill.name,
            "description": skill.description,
            "instructions": skill.body,
            "files": list(skill.files),
        }
        if skill.has_files and self.sandbox:
            output["location"] = catalogue.mount_path(skill.name)
        if given is not None and skill.has_files:
            output["note"] = (
                "this skill works through its files: follow its instructions yourself "
                "('input' runs only skills without files)"
            )
        return output


async def _subcall(
    choice: ModelChoice,
    skill: catalogue.Skill,
    given: str,
    *,
    attempts: int,
    usage: dict[str, int],
) -> ToolOutcome:
    """A prompt-only skill's answer to ``given``, from the turn's model."""
    request = ModelRequest(
        model=choice.model,
        system=catalogue.subcall_system(skill.name, skill.body),
        messages=(ChatMessage("user", ({"type": "text", "text": given},)),),
        max_tokens=SUBCALL_MAX_TOKENS,
        purpose="skill",
    )
    text: list[str] = []
    try:
        async for event in stream_with_retries(choice.provider, request, attempts=attempts):
            if isinstance(event, TextChunk):
                text.append(event.text)
            elif isinstance(event, UsageReport):
                _add_usage(usage, event)
    except ProviderError as exc:
        # The turn goes on: the model learns the skill could not answer.
        return ToolOutcome(error=f"skill {skill.name!r} could not answer: {exc.message}")
    answer = "".join(text).strip()
    if not answer:
        return ToolOutcome(error=f"skill {skill.name!r} gave no answer")
    return ToolOutcome(output={"skill": skill.name, "answer": answer})


def _add_usage(usage: dict[str, int], report: UsageReport) -> None:
    for name in USAGE_COUNTS:
        usage[name] = usage.get(name, 0) + getattr(report, name)
