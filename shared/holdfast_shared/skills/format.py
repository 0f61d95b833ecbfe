"""The Agent Skills format: a folder with ``SKILL.md`` and optional files.

``SKILL.md`` is YAML front matter between ``---`` lines (``name``,
``description``; the format's optional ``license``, ``compatibility``,
``metadata`` and ``allowed-tools`` are read and not kept) and a Markdown
body: the instructions the agent loads when it uses the skill. Other files
(``scripts/``, references, templates) sit beside it, by relative path.

A :class:`Skill` is that folder, checked: a name of lowercase letters,
digits and single hyphens (at most 64 characters), a description, a
non-empty body, and files whose paths stay inside the folder
(:func:`check_files`), within the caps below (the total a setting of the
gateway's: ``HOLDFAST_SKILL_MAX_BYTES``). The format's 1024 characters are a
limit on what the model sees: a longer description is cut to them, and the
skill carries a warning saying so (:func:`fit_description`; published skills
run past it). Built-in skills (``builtin.py``) and a tenant's own
(``store.py``) are the same type.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import yaml

from holdfast_shared.errors import ErrorCode, HoldfastError

SKILL_FILE = "SKILL.md"
NAME_PATTERN = r"^[a-z0-9]+(?:-[a-z0-9]+)*$"
MAX_NAME_CHARS = 64
MAX_DESCRIPTION_CHARS = 1024
# The caps of one skill, SKILL.md included: they bound what a tenant stores
# and what a tool-runner writes out for a sandbox. The gateway's body limit
# (HOLDFAST_MAX_BODY_BYTES) bounds the upload itself, compressed.
MAX_FILES = 100
MAX_FILE_BYTES = 1024 * 1024
MAX_TOTAL_BYTES = 4 * 1024 * 1024
MAX_PATH_CHARS = 255
MAX_PATH_DEPTH = 8
# Front matter is a few lines; YAML beyond this is no skill's.
_MAX_FRONT_MATTER_CHARS = 16 * 1024

# What check_path accepts, for the API's schema: components that are not
# "." or "..", without "/", "\\" or control characters, at most 8 levels.
_COMPONENT = (
    r"(?:[^./\\\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]*"
    r"|\.[^./\\\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]*"
    r"|\.\.[^/\\\x00-\x1f\x7f]+)"
)
PATH_PATTERN = rf"^{_COMPONENT}(?:/{_COMPONENT}){{0,{MAX_PATH_DEPTH - 1}}}$"
_NAME = re.compile(NAME_PATTERN)
_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*(?:\r?\n(.*))?\Z", re.DOTALL)
_KNOWN_KEYS = frozenset(
    {"name", "description", "license", "compatibility", "metadata", "allowed-tools"}
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class SkillInvalid(HoldfastError):
    """A skill that breaks the format; ``entry`` names the file (or field) at
    fault, ``kind`` the sort of problem (``invalid_skill``; ``conflict`` for
    a path that is a file and a folder at once)."""

    def __init__(self, entry: str, reason: str, *, kind: str = "invalid_skill") -> None:
        super().__init__(
            ErrorCode.INVALID_REQUEST, f"{entry}: {reason}", {"entry": entry, "reason": reason}
        )
        self.entry = entry
        self.reason = reason
        self.kind = kind


class SkillTooLarge(HoldfastError):
    """A skill over one of the caps (files, bytes per file, bytes in all)."""

    def __init__(self, message: str, *, limit: int, entry: str | None = None) -> None:
        details: dict[str, Any] = {"limit": limit}
        if entry is not None:
            details["entry"] = entry
        super().__init__(ErrorCode.SKILL_TOO_LARGE, message, details)
        self.entry = entry
        self.limit = limit


def check_name(name: str) -> str:
    """``name`` if it is a valid skill name; else ValueError saying why."""
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"a skill name has at most {MAX_NAME_CHARS} characters")
    if not _NAME.fullmatch(name):
        raise ValueError(
            "a skill name is lowercase letters, digits and single hyphens, "
            "neither starting nor ending with a hyphen"
        )
    return name


def check_description(description: str) -> str:
    if not description.strip():
        raise ValueError("the description is blank")
    if "\x00" in description:
        raise ValueError("the description contains a NUL character")
    return description


def fit_description(description: str) -> tuple[str, str | None]:
    """``description`` cut to :data:`MAX_DESCRIPTION_CHARS` (at a word when one
    ends near), and the warning to give when it was cut, else None."""
    if len(description) <= MAX_DESCRIPTION_CHARS:
        return description, None
    head = description[: MAX_DESCRIPTION_CHARS - 1]
    space = head.rfind(" ", MAX_DESCRIPTION_CHARS - 100)
    cut = (head[:space] if space > 0 else head).rstrip() + "…"
    warning = (
        f"the description has {len(description)} characters; the model sees its first "
        f"{len(cut)} (the Agent Skills limit is {MAX_DESCRIPTION_CHARS})"
    )
    return cut, warning


def check_path(path: str) -> str:
    """``path`` if it is a safe relative path inside a skill's folder; else
    :class:`SkillInvalid` naming it. Refused: absolute paths, ``..`` and ``.``
    components, empty components, backslashes, control characters."""
    shown = path if len(path) <= 300 else path[:300] + "…"
    if not path:
        raise SkillInvalid("(empty path)", "an empty file name")
    if _CONTROL.search(path):
        raise SkillInvalid(repr(shown), "control characters in a file name")
    if path.startswith("/"):
        raise SkillInvalid(shown, "an absolute path")
    if "\\" in path:
        raise SkillInvalid(shown, "a backslash in a file name (paths use '/')")
    parts = path.split("/")
    if ".." in parts:
        raise SkillInvalid(shown, "a '..' component leads outside the skill's folder")
    if any(part in ("", ".") for part in parts):
        raise SkillInvalid(shown, "an empty or '.' component")
    if len(path) > MAX_PATH_CHARS or len(parts) > MAX_PATH_DEPTH:
        raise SkillInvalid(
            shown, f"a path of at most {MAX_PATH_CHARS} characters and {MAX_PATH_DEPTH} levels"
        )
    return path


def check_files(
    files: Mapping[str, bytes], *, with_skill_file: bool, max_total_bytes: int = MAX_TOTAL_BYTES
) -> None:
    """Every path safe, no file also a folder of another, and the caps kept.

    ``with_skill_file``: whether ``files`` holds SKILL.md itself (an archive)
    or not (the skill's other files).
    """
    for path in files:
        check_path(path)
    count = len(files) + (0 if with_skill_file else 1)
    if count > MAX_FILES:
        raise SkillTooLarge(
            f"a skill has at most {MAX_FILES} files (SKILL.md included), this one {count}",
            limit=MAX_FILES,
        )
    folders = {path.rsplit("/", i)[0] for path in files for i in range(1, path.count("/") + 1)}
    for path in sorted(files):
        if path in folders:
            raise SkillInvalid(path, "is both a file and a folder", kind="conflict")
        if len(files[path]) > MAX_FILE_BYTES:
            raise SkillTooLarge(
                f"{path}: a file of a skill has at most {MAX_FILE_BYTES} bytes",
                limit=MAX_FILE_BYTES,
                entry=path,
            )
    total = sum(len(content) for content in files.values())
    if total > max_total_bytes:
        raise SkillTooLarge(
            f"a skill's files together have at most {max_total_bytes} bytes, these {total}",
            limit=max_total_bytes,
        )


def parse_skill_file(text: str) -> tuple[str, str, str]:
    """``(name, description, body)`` of a SKILL.md; :class:`SkillInvalid` naming
    what is wrong."""
    found = _FRONT_MATTER.match(text)
    if found is None:
        raise SkillInvalid(SKILL_FILE, "starts with YAML front matter between '---' lines")
    if len(found[1]) > _MAX_FRONT_MATTER_CHARS:
        raise SkillInvalid(SKILL_FILE, "the front matter is too long")
    try:
        front: Any = yaml.safe_load(found[1])
    except yaml.YAMLError as exc:
        raise SkillInvalid(SKILL_FILE, f"the front matter is not YAML: {exc}") from None
    if not isinstance(front, dict):
        raise SkillInvalid(SKILL_FILE, "the front matter is not a mapping")
    unknown = sorted(str(key) for key in front if key not in _KNOWN_KEYS)
    if unknown:
        raise SkillInvalid(SKILL_FILE, f"unknown front matter field {unknown[0]!r}")
    name, description = front.get("name"), front.get("description")
    if not isinstance(name, str):
        raise SkillInvalid(f"{SKILL_FILE}: name", "a string is required")
    if not isinstance(description, str):
        raise SkillInvalid(f"{SKILL_FILE}: description", "a string is required")
    try:
        check_name(name)
    except ValueError as exc:
        raise SkillInvalid(f"{SKILL_FILE}: name", str(exc)) from None
    try:
        check_description(description)
    except ValueError as exc:
        raise SkillInvalid(f"{SKILL_FILE}: description", str(exc)) from None
    body = (found[2] or "").strip()
    if not body:
        raise SkillInvalid(SKILL_FILE, "the body (the skill's instructions) is empty")
    return name, description.strip(), body


def render_skill_file(name: str, description: str, body: str) -> str:
    """The SKILL.md of a skill, as the engine writes it out for a sandbox."""
    front = yaml.safe_dump(
        {"name": name, "description": description},
        sort_keys=False,
        allow_unicode=True,
        width=1_000_000,
    )
    return f"---\n{front}---\n\n{body.strip()}\n"


@dataclass(frozen=True)
class Skill:
    """One skill: its SKILL.md's parts and its other files (``files``: by
    relative path, never SKILL.md itself)."""

    name: str
    description: str
    body: str
    files: Mapping[str, bytes] = field(default_factory=lambda: MappingProxyType({}))
    builtin: bool = False
    # What was changed to make it fit (a description cut to the model's limit).
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def skill_file(self) -> bytes:
        return render_skill_file(self.name, self.description, self.body).encode()

    def contents(self) -> dict[str, bytes]:
        """Every file of the folder, SKILL.md included, by path (sorted)."""
        return {SKILL_FILE: self.skill_file(), **{p: self.files[p] for p in sorted(self.files)}}

    @property
    def size_bytes(self) -> int:
        return sum(len(content) for content in self.contents().values())

    @property
    def digest(self) -> str:
        """SHA-256 of the folder's paths and bytes: equal digests, equal folders."""
        sha = hashlib.sha256()
        for path, content in self.contents().items():
            encoded = path.encode()
            sha.update(len(encoded).to_bytes(4, "big") + encoded)
            sha.update(len(content).to_bytes(8, "big") + content)
        return sha.hexdigest()

    @property
    def has_files(self) -> bool:
        return bool(self.files)


def skill_from_folder(
    files: Mapping[str, bytes], *, builtin: bool = False, max_total_bytes: int = MAX_TOTAL_BYTES
) -> Skill:
    """The skill a folder's files make (``files`` with SKILL.md), checked."""
    check_files(files, with_skill_file=True, max_total_bytes=max_total_bytes)
    raw = files.get(SKILL_FILE)
    if raw is None:
        raise SkillInvalid(SKILL_FILE, "missing: a skill's folder holds a SKILL.md")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SkillInvalid(SKILL_FILE, "is not UTF-8 text") from None
    name, description, body = parse_skill_file(text)
    description, warning = fit_description(description)
    others = {path: files[path] for path in sorted(files) if path != SKILL_FILE}
    warnings = (warning,) if warning else ()
    return Skill(name, description, body, MappingProxyType(others), builtin, warnings)


def new_skill(
    name: str,
    description: str,
    body: str,
    files: Mapping[str, bytes],
    *,
    max_total_bytes: int = MAX_TOTAL_BYTES,
) -> Skill:
    """A skill from its parts (``POST /skills`` as JSON), checked as a folder is
    (a description or body of blanks is the client's own business here)."""
    try:
        check_name(name)
    except ValueError as exc:
        raise SkillInvalid("name", str(exc)) from None
    if not description:
        raise SkillInvalid("description", "the description is empty")
    description, warning = fit_description(description)
    if not body:
        raise SkillInvalid("body", "the skill's instructions are empty")
    if SKILL_FILE in files:
        raise SkillInvalid(SKILL_FILE, "is made from name, description and body; not a file")
    check_files(files, with_skill_file=False, max_total_bytes=max_total_bytes)
    skill = Skill(
        name,
        description,
        body,
        MappingProxyType({path: files[path] for path in sorted(files)}),
        warnings=(warning,) if warning else (),
    )
    if len(skill.skill_file()) > MAX_FILE_BYTES:
        raise SkillTooLarge(
            f"body: SKILL.md has at most {MAX_FILE_BYTES} bytes", limit=MAX_FILE_BYTES, entry="body"
        )
    if skill.size_bytes > max_total_bytes:
        raise SkillTooLarge(
            f"a skill's files together have at most {max_total_bytes} bytes",
            limit=max_total_bytes,
        )
    return skill
