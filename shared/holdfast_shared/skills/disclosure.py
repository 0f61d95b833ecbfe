"""What the model is told of its skills, and where their files are.

Progressive disclosure: the system prompt carries only each enabled skill's
name and description (:func:`skills_section`); the ``skill`` tool loads a
skill's instructions when the model decides it needs them; a skill's files
are mounted read-only in the task's workspace at ``.skills/<name>/``
(:func:`mount_path`) for the sandboxed tools of a turn of an agent that has
it. The section depends on nothing but the skills, so the system prompt
stays the same from call to call and prompt caches hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Relative to the workspace; the tool-runner mounts there, the model is told so.
MOUNT_DIR = ".skills"


class Disclosed(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def files(self) -> Sequence[str]: ...


def mount_path(name: str) -> str:
    """Where the skill's folder is, relative to the workspace."""
    return f"{MOUNT_DIR}/{name}/"


def skills_section(skills: Sequence[Disclosed], *, sandbox: bool) -> str:
    """The system prompt's section on ``skills`` ("" for none). ``sandbox``:
    whether the agent has tools that see the workspace (and so the files)."""
    if not skills:
        return ""
    lines = [
        "# Skills",
        "",
        "You have skills: tested instructions for particular kinds of work. When a request "
        "matches a skill's description, call the `skill` tool with its name before you start, "
        "read the instructions it returns, and follow them. A skill without files can also do "
        "the work itself: call `skill` with `input` (the material and what you need) and its "
        "answer is the tool's result.",
    ]
    if sandbox and any(skill.files for skill in skills):
        lines += [
            "",
            f"A skill with files has them in the workspace, read-only, at "
            f"`{MOUNT_DIR}/<name>/` (its scripts run with bash from the workspace, e.g. "
            f"`python3 {MOUNT_DIR}/<name>/scripts/<script>`); write your own files elsewhere.",
        ]
    lines.append("")
    for skill in skills:
        line = f"- **{skill.name}**: {skill.description}"
        if sandbox and skill.files:
            line += f" (files in `{mount_path(skill.name)}`)"
        lines.append(line)
    return "\n".join(lines)


def subcall_system(name: str, body: str) -> str:
    """The system prompt of a prompt-only skill's sub-call: the skill's
    instructions, framed for a model that answers another agent."""
    return (
        f'You are carrying out the skill "{name}" for an AI agent, which called you with the '
        "input below. Follow the skill's instructions and answer with the result only: your "
        "answer goes back to the agent as the result of its tool call. You cannot call tools "
        "or ask questions; when the input is not enough, do what you can and say what is "
        "missing.\n\n"
        f"# Skill {name}\n\n{body}"
    )
