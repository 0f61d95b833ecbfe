"""Unmounting the workspaces tool-runners left under a root.

Each task's workspace is a filesystem of its own (``loop-ext4`` or ``tmpfs``,
see the tool-runner's ``workspaces.py``), mounted under
``HOLDFAST_WORKSPACE_ROOT``. The mounts rightly outlive the runner that made
them, for the next runner; an environment that goes away takes them with it,
or its directory could not be removed and loop devices would pile up.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

# /proc/self/mounts writes a space, tab, newline or backslash in a path as \ooo.
_OCTAL = re.compile(r"\\([0-7]{3})")


def mounts_under(root: str | os.PathLike[str]) -> list[str]:
    """Mount points strictly under ``root``, deepest first."""
    prefix = f"{Path(root).resolve()}/"
    points = [
        _OCTAL.sub(lambda m: chr(int(m[1], 8)), line.split()[1])
        for line in Path("/proc/self/mounts").read_text().splitlines()
    ]
    return sorted((p for p in points if p.startswith(prefix)), reverse=True)


def unmount_workspaces(root: str | os.PathLike[str] | None) -> None:
    """Unmount every filesystem mounted under ``root`` (lazily: a process still
    inside one does not keep it)."""
    if not root:
        return
    for point in mounts_under(root):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
