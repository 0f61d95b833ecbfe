"""The tool catalogue: declared once as JSON Schema, translated per provider.

The loop-worker offers these to the model; the tool-runner executes them.
``DEFAULT_PERMISSIONS`` is the policy when an agent sets none: reads run,
anything that writes or executes asks the user first.

Each tool a tool-runner runs also has an effect class (:data:`Effect`), which
says what the engine may do when a call's outcome is unknown (its runner died
mid-call, its timeout passed with no answer): a ``read_only`` or
``idempotent`` call is run again with the same idempotency key, an
``effectful`` one never is — a person settles it (``outcome_unknown``).
``DEFAULT_EFFECTS`` gives the built-ins'; an agent may override them
(``AgentDefinition.effects``), for ``bash`` also per command pattern.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Permission = Literal["allow", "ask", "deny"]
Effect = Literal["read_only", "idempotent", "effectful"]
EFFECTS: tuple[Effect, ...] = ("read_only", "idempotent", "effectful")
# What a tool nobody classed is taken for: it may have done anything.
UNKNOWN_EFFECT: Effect = "effectful"
# An agent's effect rule for the bash commands matching a glob: ``bash:git status*``.
BASH_PATTERN_PREFIX = "bash:"


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]


def _schema(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_PATH = {"type": "string", "description": "Path relative to the task's workspace."}

BASH = ToolSpec(
    "bash",
    "Run a shell command in the task's sandboxed workspace. Returns exit code, stdout and "
    "stderr (each capped).",
    _schema(
        {
            "command": {"type": "string", "description": "The command, run with bash -c."},
            "timeout": {
                "type": "number",
                "description": "Seconds before the command is killed (default 60, max 600).",
            },
        },
        ["command"],
    ),
)
READ_FILE = ToolSpec(
    "read_file",
    "Read a UTF-8 text file from the workspace.",
    _schema({"path": _PATH}, ["path"]),
)
WRITE_FILE = ToolSpec(
    "write_file",
    "Create or overwrite a file in the workspace with the given content.",
    _schema({"path": _PATH, "content": {"type": "string"}}, ["path", "content"]),
)
EDIT_FILE = ToolSpec(
    "edit_file",
    "Replace one exact occurrence of old_string with new_string in a workspace file.",
    _schema(
        {"path": _PATH, "old_string": {"type": "string"}, "new_string": {"type": "string"}},
        ["path", "old_string", "new_string"],
    ),
)
LIST_DIR = ToolSpec(
    "list_dir",
    "List the entries of a workspace directory (default: the workspace root).",
    _schema({"path": _PATH}, []),
)

# Not run by a tool-runner: the loop parks the turn and the user's answer
# (POST /hitl/respond) is the result.
ASK_USER = ToolSpec(
    "ask_user",
    "Ask the user a question and wait for the answer (minutes or days). Use it when you "
    "cannot go on without the user's input.",
    _schema({"question": {"type": "string", "description": "The question to ask."}}, ["question"]),
)

# Not run by a tool-runner either: the loop keeps the task's scratchpad itself
# (loop-worker context/working_memory.py), shown to the model every call.
WORKING_MEMORY = ToolSpec(
    "working_memory",
    "Keep a note for the rest of this task in your working memory, shown to you on every "
    "step (and in later turns of the task): set a key to a value, or delete a key. Use it "
    "for plans, decisions, facts you will need again and open to-dos.",
    _schema(
        {
            "action": {"type": "string", "enum": ["set", "delete"]},
            "key": {"type": "string", "description": "A short name for the note."},
            "value": {"type": "string", "description": "The note (for set)."},
        },
        ["action", "key"],
    ),
)

# Run by the loop too, against the brain's long-term memory (shared
# memory/): what the agent learned in every task of the tenant (or end user).
MEMORY_SEARCH = ToolSpec(
    "memory_search",
    "Search your long-term memory: what you learned in earlier tasks with this user "
    "(facts, past episodes, people and organisations). Returns the best matches, best first.",
    _schema(
        {
            "query": {"type": "string", "description": "What to look for, in plain words."},
            "kind": {
                "type": "string",
                "enum": ["episodes", "knowledge", "social"],
                "description": "Only this kind of memory (default: all).",
            },
        },
        ["query"],
    ),
)
MEMORY_SAVE = ToolSpec(
    "memory_save",
    "Save one fact to your long-term memory, for this and every later task with this user. "
    'One atomic, self-contained statement (e.g. "The user\'s deploy target is Fly.io").',
    _schema({"fact": {"type": "string", "description": "The fact, as a full sentence."}}, ["fact"]),
)

# Run by the loop (loop-worker skills.py): loads one of the agent's skills
# (holdfast_shared.skills), or runs a prompt-only one as a sub-call to the model.
# Offered only to an agent that has skills; the enum of names is the agent's own.
SKILL = ToolSpec(
    "skill",
    "Use one of your skills (listed under Skills in your instructions). Without input: "
    "returns the skill's instructions and its files; read them before doing the work. With "
    "input, a skill without files does the work itself and returns its answer.",
    _schema(
        {
            "name": {"type": "string", "description": "The skill's name."},
            "input": {
                "type": "string",
                "description": "For a skill without files: the material to work on and what "
                "you need (omit to load the instructions).",
            },
        },
        ["name"],
    ),
)

# Run by the loop (loop-worker turn/delegation.py): starts a child task with
# another agent and waits for its answer, its events mirrored into this turn's
# stream. Offered only to an agent that names subagents; the enum is its list.
# The most workspace paths one delegate call copies into its child's workspace.
MAX_DELEGATED_PATHS = 20

DELEGATE = ToolSpec(
    "delegate",
    "Hand a self-contained piece of work to one of your subagents, which works on it in a "
    "task of its own and returns its final answer. Write the brief as you would for a "
    "colleague who has seen nothing of this conversation: the goal, what you know, what "
    "to return. Several delegate calls in one response run at the same time.",
    _schema(
        {
            "agent": {"type": "string", "description": "The subagent to delegate to."},
            "brief": {"type": "string", "description": "The work, in full."},
            "files": {
                "type": "array",
                "items": {"type": "string"},
                "maxItems": MAX_DELEGATED_PATHS,
                "description": "Paths in your workspace (files or directories) the subagent "
                "needs: copied into its workspace at the same paths before it starts.",
            },
        },
        ["agent", "brief"],
    ),
)

BUILTIN_TOOLS: tuple[ToolSpec, ...] = (
    BASH,
    READ_FILE,
    WRITE_FILE,
    EDIT_FILE,
    LIST_DIR,
    ASK_USER,
    WORKING_MEMORY,
    MEMORY_SEARCH,
    MEMORY_SAVE,
    SKILL,
    DELEGATE,
)
BUILTIN_BY_NAME = {tool.name: tool for tool in BUILTIN_TOOLS}

DEFAULT_PERMISSIONS: dict[str, Permission] = {
    "ask_user": "allow",
    "working_memory": "allow",
    "memory_search": "allow",
    "memory_save": "allow",
    "skill": "allow",
    "delegate": "allow",
    "read_file": "allow",
    "list_dir": "allow",
    "bash": "ask",
    "write_file": "ask",
    "edit_file": "ask",
}

# The tools a tool-runner runs: what running one twice would do. write_file
# writes the same content again; edit_file would find its old_string gone (or
# replace a second one), bash may do anything.
DEFAULT_EFFECTS: dict[str, Effect] = {
    "read_file": "read_only",
    "list_dir": "read_only",
    "write_file": "idempotent",
    "edit_file": "effectful",
    "bash": "effectful",
}


def builtin_effect(tool: str, tool_input: Mapping[str, Any], rules: Mapping[str, Effect]) -> Effect:
    """The effect class of a call of built-in ``tool`` under an agent's ``rules``:
    for ``bash``, the first ``bash:<glob>`` rule its command matches; else the
    rule for the tool, else its default (:data:`UNKNOWN_EFFECT` for any other)."""
    if tool == BASH.name:
        command = tool_input.get("command")
        if isinstance(command, str):
            for key, effect in rules.items():
                if key.startswith(BASH_PATTERN_PREFIX) and fnmatch.fnmatchcase(
                    command, key[len(BASH_PATTERN_PREFIX) :]
                ):
                    return effect
    return rules.get(tool) or DEFAULT_EFFECTS.get(tool, UNKNOWN_EFFECT)
