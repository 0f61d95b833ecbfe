"""Consume tool calls from ``Keys.tools`` through the ``tool-runners`` group.

Calls run concurrently (up to ``concurrency``) so a long command never holds
up another task's call. A call is acknowledged after its outcome is stored
and sent; a runner that dies leaves it pending, and another runner claims it
after ``claim_idle_ms`` — where the executor's idempotency record makes sure
it is answered, never run twice. Sooner than that, a runner whose liveness key
lapsed (``HOLDFAST_LIVENESS_SECONDS``: killed) has its calls claimed by a live
one (``holdfast_shared.liveness``), which reports a call that was in flight as
of unknown outcome within about one liveness TTL. Asset Directory probes (list a server's tools)
come on the same stream and are answered on the gateway's reply list, beside workspace
removals and checkpoint/restore requests (each job's ``kind``: ``jobs.parse_tool_job``;
reading, taking over and acknowledging: ``holdfast_shared.consuming``). Reap
requests (a turn's end, which spares the task's stdio MCP servers; a pause or
park, which closes their sessions too) arrive on a pub/sub channel, since every
runner may hold processes of that task.
"""

from __future__ import annotations

import asyncio
import logging

from holdfast_shared.background import Background, every
from holdfast_shared.consuming import Delivery, GroupConsumer, consume
from holdfast_shared.jobs import (
    AssetProbe,
    AssetProbeResult,
    ToolCallJob,
    WorkspaceFiles,
    WorkspaceRemoval,
    WorkspaceRequest,
    parse_tool_job,
)
from holdfast_shared.keys import REAP_TURN_END, TOOLS_GROUP, Keys
from holdfast_shared.liveness import scan_every
from holdfast_shared.pubsub import listen
from redis.asyncio import Redis

from holdfast_tool_runner.checkpoints import WorkspaceCheckpoints
from holdfast_tool_runner.executor import ToolExecutor
from holdfast_tool_runner.sandbox import reap_leftovers
from holdfast_tool_runner.workspace_files import WorkspaceFilesHandler
from holdfast_tool_runner.workspaces import Workspaces

log = logging.getLogger(__name__)


class ToolConsumer:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        executor: ToolExecutor,
        workspaces: Workspaces,
        *,
        consumer_name: str,
        concurrency: int,
        claim_idle_ms: int,
        liveness_seconds: float = 2.0,
        archiving: WorkspaceCheckpoints | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.executor = executor
        self.workspaces = workspaces
        self.consumer_name = consumer_name
        self.concurrency = concurrency
        self.group = GroupConsumer(
            redis, keys.tools, TOOLS_GROUP, consumer_name, claim_idle_ms=claim_idle_ms
        )
        self.archiving = archiving
        self.files = WorkspaceFilesHandler(archiving) if archiving is not None else None
        self.liveness_seconds = liveness_seconds
        self._running: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Take calls until ``stop`` is set, then let the running ones finish."""
        await self.group.ensure_group()
        try:
            async with Background() as background:
                background.start(
                    listen(self.redis, self.keys.tools_reap, self._reap, what="reap requests"),
                    name="reap-requests",
                )
                background.start(
                    every(
                        scan_every(self.liveness_seconds),
                        self._rescue,
                        what="taking over dead runners' calls",
                        wait_first=True,
                    ),
                    name="dead-runners",
                )
                await consume(
                    self.group,
                    stop,
                    self._start,
                    lambda: self._running,
                    concurrency=self.concurrency,
                )
        finally:
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)

    async def _rescue(self) -> None:
        """Take the calls of runners whose liveness key lapsed (the executor then
        answers a call that was in flight as of unknown outcome; it never runs it again)."""
        free = self.concurrency - len(self._running)
        if free <= 0:
            return
        claimed = await self.group.take_from_dead(
            self.keys.runner_alive, liveness_seconds=self.liveness_seconds, count=free
        )
        for dead, delivery in claimed:
            log.warning("tool-runner %s is gone; taking over its entry %s", dead, delivery.entry_id)
            await self._start(delivery)

    async def _start(self, delivery: Delivery) -> None:
        task = asyncio.create_task(self._handle(delivery), name=f"tool:{delivery.entry_id}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _handle(self, delivery: Delivery) -> None:
        entry_id = delivery.entry_id
        try:
            job = parse_tool_job(delivery.fields)
        except ValueError:
            log.error("dropping malformed tool call %s: %r", entry_id, delivery.fields)
            await self.group.ack(entry_id)
            return
        match job:
            case WorkspaceRemoval():
                await self._handle_removal(entry_id, job)
            case AssetProbe():
                await self._handle_probe(entry_id, job)
            case WorkspaceRequest():
                await self._handle_workspace_request(entry_id, job)
            case WorkspaceFiles():
                await self._handle_files(entry_id, job)
            case ToolCallJob():
                await self._handle_call(entry_id, job)

    async def _handle_call(self, entry_id: str, job: ToolCallJob) -> None:
        try:
            outcome = await self.executor.handle(job)
        except Exception:
            # Left pending: another runner claims it and the executor answers it.
            log.exception("tool call %s failed in the runner", job.tool_call_id)
            return
        log.info(
            "tool %s (%s) for task %s: %s",
            job.tool,
            job.tool_call_id,
            job.task_id,
            "error" if outcome.error else "ok",
        )
        await self.group.ack(entry_id)

    async def _handle_removal(self, entry_id: str, removal: WorkspaceRemoval) -> None:
        try:
            await self._remove_workspace(removal.tenant_id, removal.task_id)
        except Exception:
            # Left pending: this or another runner claims it again and
            # finishes the removal.
            log.exception("could not remove the workspace of task %s", removal.task_id)
            return
        await self.group.ack(entry_id)

    async def _handle_probe(self, entry_id: str, probe: AssetProbe) -> None:
        """List an Asset Directory server's tools for the gateway waiting on ``reply_to``."""
        connectors = self.executor.connectors
        if connectors is None:
            result = AssetProbeResult(error="MCP servers are not available on this tool-runner")
        else:
            result = await connectors.probe(probe.tenant_id, probe.server)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(probe.reply_to, result.model_dump_json())
            pipe.expire(probe.reply_to, 120)
            await pipe.execute()
        log.info(
            "probed MCP server %s of tenant %s: %s",
            probe.server,
            probe.tenant_id,
            "error" if result.error else f"{len(result.tools)} tool(s)",
        )
        await self.group.ack(entry_id)

    async def _handle_workspace_request(self, entry_id: str, request: WorkspaceRequest) -> None:
        """Checkpoint or restore a task's workspace for the service waiting on ``reply_to``."""
        if self.archiving is None:
            log.error("workspace request %s on a runner without archives", request.request_id)
        else:
            reply = await self.archiving.handle_request(request)
            log.info(
                "workspace %s of task %s: %s",
                request.action,
                request.task_id,
                reply.error or reply.archive_id,
            )
        await self.group.ack(entry_id)

    async def _handle_files(self, entry_id: str, request: WorkspaceFiles) -> None:
        """List, read, write, delete or copy a task's files for whoever waits on ``reply_to``."""
        if self.files is None:
            log.error("workspace files request %s on a runner without archives", request.request_id)
        else:
            reply = await self.files.handle(request)
            log.info(
                "workspace files %s %r of task %s: %s",
                request.action,
                request.path,
                request.task_id,
                reply.error or "ok",
            )
        await self.group.ack(entry_id)

    async def _remove_workspace(self, tenant_id: str, task_id: str) -> None:
        if self.executor.connectors is not None:
            await self.executor.connectors.task_removed(tenant_id, task_id)
        # Its processes first, so none still writes into it while it goes.
        await reap_leftovers(self.workspaces.path(tenant_id, task_id))
        removed = await asyncio.to_thread(self.workspaces.remove, tenant_id, task_id)
        if self.archiving is not None:
            await self.archiving.forget(tenant_id, task_id)
        log.info("task %s deleted: workspace %s", task_id, "removed" if removed else "absent")

    async def _reap(self, data: str) -> None:
        """A turn ended (``<tenant_id> <task_id> turn-end``) or the task stopped
        (paused, parked: ``<tenant_id> <task_id>``): kill what its tools left
        running; after a turn's normal end, but its stdio MCP servers."""
        tenant_id, task_id, *rest = data.split(" ")
        connectors = self.executor.connectors
        kept: list[object] = []
        if connectors is not None:
            if rest == [REAP_TURN_END]:
                kept = connectors.kept_servers(tenant_id, task_id)
            else:
                # Its stdio MCP sessions end (their processes are reaped below).
                await connectors.task_stopped(tenant_id, task_id)
        workspace = self.workspaces.path(tenant_id, task_id)
        killed = await reap_leftovers(workspace, sparing=kept)
        if killed:
            log.info("reaped %d leftover process group(s) of task %s", killed, task_id)
        if self.archiving is not None:
            # After the reap: nothing of the turn still writes into it.
            self.archiving.turn_ended(tenant_id, task_id)
