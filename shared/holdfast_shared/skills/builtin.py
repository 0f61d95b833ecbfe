"""The skills shipped with the engine: folders in ``builtin/`` of this package.

Each folder is a skill in the Agent Skills format, named as its SKILL.md
says. Their names are reserved: no tenant's skill may take one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib import resources
from importlib.abc import Traversable
from types import MappingProxyType

from holdfast_shared.skills.format import Skill, SkillInvalid, SkillTooLarge, skill_from_folder

# Left out of a folder: what running or packaging leaves beside the files.
_IGNORED = frozenset({"__pycache__", ".DS_Store"})


def _walk(folder: Traversable, prefix: str = "") -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for entry in sorted(folder.iterdir(), key=lambda item: item.name):
        if entry.name in _IGNORED or entry.name.endswith(".pyc"):
            continue
        path = f"{prefix}{entry.name}"
        if entry.is_dir():
            files.update(_walk(entry, f"{path}/"))
        else:
            files[path] = entry.read_bytes()
    return files


@functools.cache
def builtin_skills() -> Mapping[str, Skill]:
    """The built-in skills by name, read once from the package.

    A broken folder is an error here (ValueError naming it), so a service
    started from a broken build stops at start, not mid-turn.
    """
    skills: dict[str, Skill] = {}
    root = resources.files("holdfast_shared.skills") / "builtin"
    for entry in sorted(root.iterdir(), key=lambda item: item.name):
        if not entry.is_dir() or entry.name in _IGNORED:
            continue
        try:
            skill = skill_from_folder(_walk(entry), builtin=True)
        except (SkillInvalid, SkillTooLarge) as exc:
            raise ValueError(f"built-in skill {entry.name}: {exc.message}") from None
        if skill.name != entry.name:
            raise ValueError(f"built-in skill {entry.name} is named {skill.name!r}")
        skills[skill.name] = skill
    return MappingProxyType(skills)
