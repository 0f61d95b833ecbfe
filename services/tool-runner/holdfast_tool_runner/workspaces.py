"""Per-task workspaces: one directory per task, kept across its turns.

A workspace is created on the task's first tool call and removed when the
task is deleted. Only its own task's sandbox ever mounts it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from holdfast_shared.ids import is_valid_id


class Workspaces:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, task_id: str) -> Path:
        # Task ids are validated at the gateway; checked again because this
        # becomes a path on the host.
        if not is_valid_id(task_id) or task_id in (".", ".."):
            raise ValueError(f"invalid task id {task_id!r}")
        return self.root / task_id

    def ensure(self, task_id: str) -> Path:
        path = self.path(task_id)
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def remove(self, task_id: str) -> bool:
        path = self.path(task_id)
        if not path.exists():
            return False
        shutil.rmtree(path)
        return True
