"""Workspace checkpoints off this runner's disk, and restores onto it.

The archive store (``HOLDFAST_WORKSPACE_STORE``, shared ``workspace_checkpoints``)
holds each task's archives and its *head*: the archive its workspace currently
is. This runner keeps, per task, the manifest it last wrote or restored and its
archive id (``<root>/.archive-state/<tenant>/<task>.json``) to diff against, a
lock file and a last-used stamp beside it.

When it archives:
* at each turn's end (``turn_ended``, from the reap broadcast), incrementally:
  a wiped disk loses at most the files of the turn in flight;
* on a ``WorkspaceRequest`` (checkpoint or restore) from another service;
* before releasing an idle workspace (``hibernation.py``).

Before a tool call (``in_use``) the runner checks that its copy *is* the head
(its state names the head's archive id). If not — the workspace was never
here, the disk was wiped, it was hibernated, or another machine's runner
archived a newer one — it restores the head first. A copy that is not the head
is never archived over it.

Locks: a tool call holds the task's lock shared (parallel calls of one task run
together); a checkpoint, restore or hibernation holds it exclusive. What outlives
a call (a stdio MCP server) is stopped for a checkpoint (``sandbox.frozen``) and
killed before a restore (``reap_leftovers``). They are
``flock``s on a file, so runner processes sharing the workspace root agree,
and are taken by polling, so a waiter never blocks a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from holdfast_shared.ids import is_valid_id, new_id
from holdfast_shared.jobs import WorkspaceReply, WorkspaceRequest
from holdfast_shared.keys import Keys
from holdfast_shared.workspace_checkpoints import ArchiveStore, Manifest, ManifestError
from redis.asyncio import Redis

from holdfast_tool_runner.sandbox import frozen, reap_leftovers
from holdfast_tool_runner.workspace_tree import ArchiveError, checkpoint, restore
from holdfast_tool_runner.workspaces import WorkspaceError, Workspaces

log = logging.getLogger(__name__)

STATE_DIR = ".archive-state"
# How long a request's answer is kept for a redelivery of it.
_DONE_TTL_SECONDS = 600
_REPLY_TTL_SECONDS = 120
_LOCK_POLL_SECONDS = 0.02


class WorkspaceCheckpoints:
    """Checkpoints, restores and the local state they diff against, for ``workspaces``."""

    def __init__(
        self,
        workspaces: Workspaces,
        store: ArchiveStore,
        redis: Redis,
        keys: Keys,
        *,
        archive_on_turn_end: bool = True,
    ) -> None:
        self.workspaces = workspaces
        self.store = store
        self.redis = redis
        self.keys = keys
        self.archive_on_turn_end = archive_on_turn_end
        self._background: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        """Let turn-end checkpoints under way finish."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -- local state ---------------------------------------------------------------

    def _state_file(self, tenant_id: str, task_id: str, suffix: str) -> Path:
        self.workspaces.path(tenant_id, task_id)  # checks both ids
        return self.workspaces.root / STATE_DIR / tenant_id / f"{task_id}.{suffix}"

    def read_state(self, tenant_id: str, task_id: str) -> tuple[str, Manifest] | None:
        """(archive id, manifest) this disk last wrote or restored for the task."""
        try:
            raw = json.loads(self._state_file(tenant_id, task_id, "json").read_bytes())
            archive_id = raw["archive_id"]
            if not isinstance(archive_id, str) or not is_valid_id(archive_id):
                return None
            return archive_id, Manifest.load(raw["manifest"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # none, or unreadable: restore rather than trust it

    def state_id(self, tenant_id: str, task_id: str) -> str | None:
        """Just the archive id of the state: what every tool call checks, without
        parsing a manifest of thousands of entries."""
        try:
            return self._state_file(tenant_id, task_id, "id").read_text().strip() or None
        except OSError:
            return None

    def _write_state(
        self, tenant_id: str, task_id: str, archive_id: str, manifest: Manifest
    ) -> None:
        # The manifest first, its id last: a crash between leaves an id that is
        # not the head's, and the next call restores rather than trusts.
        for suffix, body in (
            ("json", json.dumps({"archive_id": archive_id, "manifest": manifest.to_json()})),
            ("id", archive_id),
        ):
            path = self._state_file(tenant_id, task_id, suffix)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            temporary.write_text(body)
            os.replace(temporary, path)

    def drop_state(self, tenant_id: str, task_id: str) -> None:
        """Forget the task's local state (its workspace left this disk)."""
        for suffix in ("id", "json", "used"):
            with contextlib.suppress(FileNotFoundError):
                self._state_file(tenant_id, task_id, suffix).unlink()

    def touch(self, tenant_id: str, task_id: str) -> None:
        path = self._state_file(tenant_id, task_id, "used")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.touch()

    def idle_seconds(self, tenant_id: str, task_id: str) -> float:
        """Since the task's last tool call here (or its workspace's last change)."""
        for path in (
            self._state_file(tenant_id, task_id, "used"),
            self.workspaces.path(tenant_id, task_id),
        ):
            with contextlib.suppress(OSError):
                return time.time() - path.stat().st_mtime
        return 0.0

    # -- the task's lock ---------------------------------------------------------------

    async def lock(
        self, tenant_id: str, task_id: str, *, exclusive: bool, wait: bool = True
    ) -> int | None:
        """An fd holding the task's lock (close it to release); None if ``not wait``
        and it is taken."""
        path = self._state_file(tenant_id, task_id, "lock")
        await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        try:
            while True:
                try:
                    fcntl.flock(fd, mode)
                    return fd
                except BlockingIOError:
                    if not wait:
                        os.close(fd)
                        return None
                    await asyncio.sleep(_LOCK_POLL_SECONDS)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def release(fd: int) -> None:
        """Release a lock ``lock`` returned."""
        os.close(fd)

    @contextlib.asynccontextmanager
    async def exclusive(self, tenant_id: str, task_id: str) -> AsyncIterator[None]:
        fd = await self.lock(tenant_id, task_id, exclusive=True)
        assert fd is not None
        try:
            yield
        finally:
            os.close(fd)

    # -- before a tool call --------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def in_use(self, tenant_id: str, task_id: str) -> AsyncIterator[Path]:
        """The task's workspace, the head restored into it first if this copy is
        not the head; held (shared) until the call is done. WorkspaceError if it
        cannot be made ready."""
        fd, path = await self._prepare(tenant_id, task_id)
        try:
            yield path
        finally:
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(self.touch, tenant_id, task_id)
            os.close(fd)

    async def _prepare(self, tenant_id: str, task_id: str) -> tuple[int, Path]:
        # The root itself may have been wiped: Workspaces makes it only at start.
        await asyncio.to_thread(self.workspaces.root.mkdir, parents=True, exist_ok=True, mode=0o700)
        fd = await self.lock(tenant_id, task_id, exclusive=False)
        assert fd is not None
        try:
            head = await self.store.head(tenant_id, task_id)
            if head is not None and not await self._is_head(tenant_id, task_id, head):
                os.close(fd)
                fd = None
                async with self.exclusive(tenant_id, task_id):
                    head = await self.store.head(tenant_id, task_id)
                    if head is not None and not await self._is_head(tenant_id, task_id, head):
                        await self._restore_locked(tenant_id, task_id, head)
                fd = await self.lock(tenant_id, task_id, exclusive=False)
                assert fd is not None
            path = await asyncio.to_thread(self.workspaces.ensure, tenant_id, task_id)
            await asyncio.to_thread(self.touch, tenant_id, task_id)
            return fd, path
        except BaseException as exc:
            if fd is not None:
                os.close(fd)
            if isinstance(exc, ArchiveError | ManifestError | OSError):
                raise WorkspaceError(f"could not restore its last archive: {exc}") from exc
            raise

    async def _is_head(self, tenant_id: str, task_id: str, head: str) -> bool:
        if not await asyncio.to_thread(self.workspaces.exists, tenant_id, task_id):
            return False
        return await asyncio.to_thread(self.state_id, tenant_id, task_id) == head

    # -- checkpoint and restore (the exclusive lock held) ---------------------------------

    async def checkpoint_locked(self, tenant_id: str, task_id: str, reason: str) -> str | None:
        """Archive the local copy if it is the head's lineage; the head after.

        None: the task has no workspace here and was never archived.
        """
        head = await self.store.head(tenant_id, task_id)
        if not await asyncio.to_thread(self.workspaces.exists, tenant_id, task_id):
            return head
        state = await asyncio.to_thread(self.read_state, tenant_id, task_id)
        if head is not None and (state is None or state[0] != head):
            # Another runner archived (or rolled back) since this copy was made:
            # the head is the workspace now, and this copy is stale.
            log.info("workspace of task %s here is not its head %s; not archived", task_id, head)
            return head
        path = self.workspaces.path(tenant_id, task_id)
        # The lock keeps the task's calls out, not a process that outlives its call
        # (a stdio MCP server): it is stopped until the archive is taken.
        async with frozen(path):
            result = await checkpoint(
                self.store,
                tenant_id,
                task_id,
                path,
                previous=state[1] if state else None,
                # "Nothing changed" may answer with this archive only if it is the head.
                previous_id=state[0] if state and state[0] == head else None,
                reason=reason,
            )
        if result.created:
            await asyncio.to_thread(
                self._write_state, tenant_id, task_id, result.archive_id, result.manifest
            )
            log.info(
                "workspace of task %s archived (%s) as %s: %d file(s) read, %d blob(s) stored",
                task_id,
                reason,
                result.archive_id,
                result.files_read,
                result.blobs_stored,
            )
        return result.archive_id

    async def _restore_locked(self, tenant_id: str, task_id: str, archive_id: str | None) -> str:
        """Make the local copy the archive (None: empty) and the head; its id."""
        if archive_id is None:
            manifest = Manifest({})
        else:
            found = await self.store.manifest(tenant_id, task_id, archive_id)
            if found is None:
                raise ArchiveError(f"task {task_id} has no workspace archive {archive_id!r}")
            manifest = found
        existed = await asyncio.to_thread(self.workspaces.exists, tenant_id, task_id)
        state = await asyncio.to_thread(self.read_state, tenant_id, task_id) if existed else None
        path = await asyncio.to_thread(self.workspaces.ensure, tenant_id, task_id)
        # Nothing of the task's may still write into what is being replaced.
        await reap_leftovers(path)
        # The state no longer describes the disk once the restore starts.
        await asyncio.to_thread(self.drop_state, tenant_id, task_id)
        started = time.monotonic()
        done = await restore(
            self.store, tenant_id, path, manifest, previous=state[1] if state else None
        )
        if archive_id is None:
            archive_id = new_id("wsa")
            await self.store.put_archive(tenant_id, task_id, archive_id, manifest, "restore")
        elif archive_id != await self.store.head(tenant_id, task_id):
            await self.store.set_head(tenant_id, task_id, archive_id)
        await asyncio.to_thread(self._write_state, tenant_id, task_id, archive_id, manifest)
        await asyncio.to_thread(self.touch, tenant_id, task_id)
        log.info(
            "workspace of task %s restored from %s in %.3f s: %d file(s) written",
            task_id,
            archive_id,
            time.monotonic() - started,
            done.files_written,
        )
        return archive_id

    # -- triggers ---------------------------------------------------------------------

    def turn_ended(self, tenant_id: str, task_id: str) -> None:
        """Archive the task's workspace (if this runner holds it) in the background."""
        if not self.archive_on_turn_end:
            return
        task = asyncio.create_task(
            self._turn_end_checkpoint(tenant_id, task_id), name=f"turn-end-archive:{task_id}"
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _turn_end_checkpoint(self, tenant_id: str, task_id: str) -> None:
        try:
            if not await asyncio.to_thread(self.workspaces.exists, tenant_id, task_id):
                return
            async with self.exclusive(tenant_id, task_id):
                await self.checkpoint_locked(tenant_id, task_id, "turn_end")
        except Exception:
            # The next turn end (or hibernation) tries again; only a disk lost
            # meanwhile loses more than one turn's files.
            log.warning("could not archive the workspace of task %s", task_id, exc_info=True)

    async def handle_request(self, request: WorkspaceRequest) -> WorkspaceReply:
        """Carry out a checkpoint or restore request once, and answer ``reply_to``;
        a redelivered one is answered from the first one's result."""
        done_key = self.keys.workspace_done(request.request_id)
        recorded = await self.redis.get(done_key)
        if recorded is not None:
            reply = WorkspaceReply.model_validate_json(recorded)
        else:
            reply = await self._carry_out(request)
            await self.redis.set(done_key, reply.model_dump_json(), ex=_DONE_TTL_SECONDS)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(request.reply_to, reply.model_dump_json())
            pipe.expire(request.reply_to, _REPLY_TTL_SECONDS)
            await pipe.execute()
        return reply

    async def _carry_out(self, request: WorkspaceRequest) -> WorkspaceReply:
        tenant_id, task_id = request.tenant_id, request.task_id
        try:
            async with self.exclusive(tenant_id, task_id):
                if request.action == "checkpoint":
                    archive_id = await self.checkpoint_locked(tenant_id, task_id, "checkpoint")
                else:
                    archive_id = await self._restore_locked(tenant_id, task_id, request.archive_id)
        except (ArchiveError, ManifestError, WorkspaceError, ValueError) as exc:
            return WorkspaceReply(error=str(exc))
        except Exception as exc:
            log.exception("workspace %s of task %s failed", request.action, task_id)
            return WorkspaceReply(error=f"the tool-runner failed: {type(exc).__name__}: {exc}")
        return WorkspaceReply(archive_id=archive_id)

    async def forget(self, tenant_id: str, task_id: str) -> None:
        """A deleted task: drop its local state and its archives."""
        await asyncio.to_thread(self.drop_state, tenant_id, task_id)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self._state_file(tenant_id, task_id, "lock").unlink)
        await self.store.forget_task(tenant_id, task_id)
