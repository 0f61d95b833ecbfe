"""Skills' folders on this host, for the sandbox to mount read-only.

A tool call of an agent with skills names them (``ToolCallJob.skills``);
each is written out once per content, under ``<root>/<digest>/`` (the
SHA-256 of its paths and bytes, ``Skill.digest``), and mounted read-only at
``.skills/<name>/`` in the call's workspace (``sandbox/bwrap.py``). The
built-ins come from the shared package, a tenant's own from PostgreSQL;
only a digest not yet on disk has its bytes read. Folders are written to a
temporary name and renamed into place, so a call never sees half of one,
and two runners writing the same digest at once both end with the same
folder. Files are read-only (scripts under ``scripts/`` executable) and
never change: a changed skill is a new digest.

The root is ``<workspaces>/.skill-cache``: under the workspaces' root, closed
to other host users, and never taken for a tenant (ids do not start with
``.``). Folders of skills nobody uses any more stay until an operator
clears the directory; each is at most a skill's size cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

from holdfast_shared.db.models import SkillRecord
from holdfast_shared.skills import MOUNT_DIR, Skill, builtin_skills, load_skills
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

CACHE_DIR = ".skill-cache"
_FILE_MODE = 0o444
_EXEC_MODE = 0o555
_DIR_MODE = 0o555


class SkillFiles:
    """The skills' folders under ``root``, written as calls need them."""

    def __init__(self, root: Path, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.root = root
        self.sessions = sessions
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    async def mounts(self, tenant_id: str, names: Sequence[str]) -> tuple[tuple[Path, str], ...]:
        """(folder, name) of each of ``names`` the tenant has (built-in or its
        own), in order; names it no longer has are left out."""
        wanted = list(dict.fromkeys(names))
        if not wanted:
            return ()
        builtins = builtin_skills()
        digests = {name: builtins[name].digest for name in wanted if name in builtins}
        own = [name for name in wanted if name not in builtins]
        if own:
            async with self.sessions() as session:
                rows = await session.execute(
                    select(SkillRecord.name, SkillRecord.digest).where(
                        SkillRecord.tenant_id == tenant_id, SkillRecord.name.in_(own)
                    )
                )
                digests.update({name: digest for name, digest in rows.tuples()})
                missing = [name for name in own if name in digests and not self._has(digests[name])]
                fetched = await load_skills(session, tenant_id, missing) if missing else []
        else:
            fetched = []
        skills = {skill.name: skill for skill in fetched}
        skills.update({name: builtins[name] for name in wanted if name in builtins})
        found: list[tuple[Path, str]] = []
        for name in wanted:
            if name not in digests:
                continue
            digest = digests[name]
            if not self._has(digest):
                await asyncio.to_thread(self._write, digest, skills[name])
            found.append((self.root / digest, name))
        return tuple(found)

    def _has(self, digest: str) -> bool:
        return (self.root / digest).is_dir()

    def _write(self, digest: str, skill: Skill) -> None:
        """Write ``skill``'s folder as ``<root>/<digest>`` (blocking)."""
        target = self.root / digest
        if target.is_dir():
            return
        staging = self.root / f".{digest}.{secrets.token_hex(4)}"
        staging.mkdir(mode=0o700)
        try:
            for path, content in skill.contents().items():
                file = staging / path
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_bytes(content)
                mode = _EXEC_MODE if path.startswith("scripts/") else _FILE_MODE
                file.chmod(mode)
            for folder, dirs, _files in os.walk(staging):
                for name in dirs:
                    Path(folder, name).chmod(_DIR_MODE)
            staging.chmod(_DIR_MODE)
            try:
                staging.rename(target)
            except OSError:
                if not target.is_dir():  # not another runner's copy: a real failure
                    raise
        finally:
            if staging.exists():
                _remove(staging)


def skills_dir_problem(workspace: Path) -> str | None:
    """Why skills cannot be mounted in ``workspace`` (its ``.skills`` is not a
    folder: a file or a link the tools left), or None. Blocking."""
    try:
        mode = (workspace / MOUNT_DIR).lstat().st_mode
    except FileNotFoundError:
        return None  # bwrap makes the mount point
    if stat.S_ISDIR(mode):
        return None
    return (
        f"'{MOUNT_DIR}' in the workspace is not a folder, and the agent's skills are mounted "
        f"there: remove or rename it, then run the command again"
    )


def release_skills_dir(workspace: Path) -> None:
    """Remove the empty mount point bwrap made for ``.skills`` in the workspace,
    so the task's files stay as its tools left them (blocking). A folder with
    something in it, or anything else of that name, is the task's own: kept."""
    with contextlib.suppress(OSError):
        (workspace / MOUNT_DIR).rmdir()


def _remove(folder: Path) -> None:
    """Remove a folder this module wrote read-only."""
    for parent, dirs, _files in os.walk(folder):
        for name in dirs:
            with contextlib.suppress(OSError):
                Path(parent, name).chmod(0o700)
    with contextlib.suppress(OSError):
        folder.chmod(0o700)
    shutil.rmtree(folder, ignore_errors=True)
