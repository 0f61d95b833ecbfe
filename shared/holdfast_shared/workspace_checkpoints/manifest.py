"""What an archive of a workspace holds: its manifest.

A manifest lists every directory, regular file and symlink of the workspace by
its path relative to the workspace (``/``-separated, no ``.`` or ``..``): a
file by the SHA-256 of its content (the blob), its mode, size and mtime; a
symlink by its target, verbatim (it is restored as a link and never followed);
a directory by its mode, so empty ones come back too.

A manifest read back from storage is input like any other: :meth:`Manifest.load`
refuses paths that would land outside the workspace or under a symlink, before
anything is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

VERSION = 1
# Permission bits a restore gives back; setuid/setgid are never restored (the
# workspace is mounted nosuid anyway, and a manifest is untrusted input).
MODE_MASK = 0o1777
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_MAX_PATH = 4096


class ManifestError(ValueError):
    """A manifest that must not be restored; the message names the entry."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One directory (``kind="dir"``), regular file (``"file"``) or symlink (``"link"``)."""

    kind: Literal["dir", "file", "link"]
    mode: int = 0o755
    size: int = 0
    mtime_ns: int = 0
    sha256: str = ""
    target: str = ""

    def to_json(self, path: str) -> list[Any]:
        if self.kind == "dir":
            return [path, "d", self.mode]
        if self.kind == "link":
            return [path, "l", self.target]
        return [path, "f", self.mode, self.size, self.mtime_ns, self.sha256]


@dataclass(frozen=True)
class Manifest:
    """Path → :class:`Entry`; an empty manifest is an empty workspace."""

    entries: dict[str, Entry]

    @property
    def files(self) -> int:
        return sum(1 for e in self.entries.values() if e.kind == "file")

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries.values() if e.kind == "file")

    def hashes(self) -> set[str]:
        return {e.sha256 for e in self.entries.values() if e.kind == "file"}

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "entries": [entry.to_json(path) for path, entry in sorted(self.entries.items())],
        }

    @classmethod
    def load(cls, data: Any) -> Manifest:
        """Parse and check a stored manifest; ManifestError names what is wrong."""
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ManifestError("not a workspace manifest of version 1")
        raw = data.get("entries")
        if not isinstance(raw, list):
            raise ManifestError("manifest entries must be a list")
        entries: dict[str, Entry] = {}
        for item in raw:
            path, entry = _entry(item)
            if path in entries:
                raise ManifestError(f"path {path!r} appears twice")
            entries[path] = entry
        for path in entries:
            check_parents(path, entries)
        return cls(entries)


def check_path(path: object) -> str:
    """``path`` if it is a relative path that stays inside the workspace."""
    if not isinstance(path, str) or not path or len(path) > _MAX_PATH:
        raise ManifestError(f"invalid path {path!r}")
    if path.startswith("/") or "\x00" in path or "\\" in path:
        raise ManifestError(f"path {path!r} escapes the workspace")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ManifestError(f"path {path!r} escapes the workspace")
    return path


def check_parents(path: str, entries: dict[str, Entry]) -> None:
    """Every directory above ``path`` must be a directory entry: a file under a
    symlink (``link -> /etc``, then ``link/passwd``) would be written through it."""
    parts = path.split("/")
    for depth in range(1, len(parts)):
        parent = "/".join(parts[:depth])
        found = entries.get(parent)
        if found is None or found.kind != "dir":
            raise ManifestError(f"path {path!r}: its parent {parent!r} is not a directory")


def _int(value: object, what: str, path: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ManifestError(f"path {path!r}: invalid {what} {value!r}")
    return value


def _entry(item: object) -> tuple[str, Entry]:
    if not isinstance(item, list) or len(item) < 3:
        raise ManifestError(f"invalid manifest entry {item!r}")
    path = check_path(item[0])
    kind = item[1]
    if kind == "d" and len(item) == 3:
        return path, Entry("dir", mode=_int(item[2], "mode", path) & MODE_MASK)
    if kind == "l" and len(item) == 3:
        target = item[2]
        if not isinstance(target, str) or not target or "\x00" in target:
            raise ManifestError(f"path {path!r}: invalid symlink target")
        return path, Entry("link", target=target)
    if kind == "f" and len(item) == 6:
        digest = item[5]
        if not isinstance(digest, str) or not _HASH_RE.match(digest):
            raise ManifestError(f"path {path!r}: invalid sha256 {digest!r}")
        return path, Entry(
            "file",
            mode=_int(item[2], "mode", path) & MODE_MASK,
            size=_int(item[3], "size", path),
            mtime_ns=_int(item[4], "mtime", path),
            sha256=digest,
        )
    raise ManifestError(f"path {path!r}: invalid entry {item!r}")
