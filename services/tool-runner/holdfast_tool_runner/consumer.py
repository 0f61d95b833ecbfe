"""Consume tool calls from ``Keys.tools`` through the ``tool-runners`` group.

Calls run concurrently (up to ``concurrency``) so a long command never holds
up another task's call. A call is acknowledged after its outcome is stored
and sent; a runner that dies leaves it pending, and another runner claims it
after ``claim_idle_ms`` — where the executor's idempotency record makes sure
it is answered, never run twice. Sooner than that, a runner whose liveness key
lapsed (``HOLDFAST_LIVENESS_SECONDS``: killed) has its calls claimed by a live
one (``holdfast_shared.orphans``), which reports a call that was in flight as
interrupted within about one liveness TTL. Asset Directory probes (list a server's tools)
come on the same stream and are answered on the gateway's reply list. Turn-end
reap requests (which also close the task's MCP sessions) arrive on a pub/sub
channel, since every runner may hold processes of that task.
"""

from __future__ import annotations

import asyncio
import logging

from holdfast_shared.background import Background, every
from holdfast_shared.jobs import (
    AssetProbe,
    AssetProbeResult,
    ToolCallJob,
    WorkspaceRemoval,
    WorkspaceRequest,
)
from holdfast_shared.keys import TOOLS_GROUP, Keys
from holdfast_shared.orphans import claim_from_dead, scan_every
from holdfast_shared.pubsub import listen
from holdfast_shared.streams import ensure_group
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from holdfast_tool_runner.archiving import WorkspaceArchiving
from holdfast_tool_runner.executor import ToolExecutor
from holdfast_tool_runner.sandbox import reap_leftovers
from holdfast_tool_runner.workspaces import Workspaces

log = logging.getLogger(__name__)

BLOCK_MS = 1000

Entry = tuple[str, dict[str, str]]


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
        archiving: WorkspaceArchiving | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.executor = executor
        self.workspaces = workspaces
        self.consumer_name = consumer_name
        self.concurrency = concurrency
        self.claim_idle_ms = claim_idle_ms
        self.archiving = archiving
        self.liveness_seconds = liveness_seconds
        self._running: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        await ensure_group(self.redis, self.keys.tools, TOOLS_GROUP)
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
                while not stop.is_set():
                    free = self.concurrency - len(self._running)
                    if free <= 0:
                        await asyncio.wait(self._running, return_when=asyncio.FIRST_COMPLETED)
                        continue
                    for entry in await self._next_entries(free):
                        self._start(entry)
        finally:
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)

    async def _next_entries(self, count: int) -> list[Entry]:
        try:
            return await self._read(count)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("the tools group is gone (Redis lost its data?); recreating it")
            await ensure_group(self.redis, self.keys.tools, TOOLS_GROUP)
        except (RedisConnectionError, RedisTimeoutError):
            log.warning("Redis unreachable; retrying", exc_info=True)
            await asyncio.sleep(0.5)
        return []

    async def _read(self, count: int) -> list[Entry]:
        # Calls a dead runner left pending first: they are the oldest.
        _cursor, claimed, *_ = await self.redis.xautoclaim(
            self.keys.tools,
            TOOLS_GROUP,
            self.consumer_name,
            min_idle_time=self.claim_idle_ms,
            count=count,
        )
        # Redis 6.2 reports claimed-but-deleted entries as (None, None).
        entries: list[Entry] = [e for e in claimed if e and e[0] is not None]
        if entries:
            return entries
        reply = await self.redis.xreadgroup(
            TOOLS_GROUP, self.consumer_name, {self.keys.tools: ">"}, count=count, block=BLOCK_MS
        )
        return [entry for _stream, stream_entries in reply or [] for entry in stream_entries]

    async def _rescue(self) -> None:
        """Take the calls of runners whose liveness key lapsed (the executor then
        answers a call that was in flight as interrupted; it never runs it again)."""
        free = self.concurrency - len(self._running)
        if free <= 0:
            return
        try:
            claimed = await claim_from_dead(
                self.redis,
                self.keys.tools,
                TOOLS_GROUP,
                self.consumer_name,
                self.keys.runner_alive,
                liveness_seconds=self.liveness_seconds,
                count=free,
            )
        except (RedisConnectionError, RedisTimeoutError):
            return  # Redis is restarting: the read loop says so, and retries
        for dead, entry_id, fields in claimed:
            log.warning("tool-runner %s is gone; taking over its entry %s", dead, entry_id)
            self._start((entry_id, fields))

    def _start(self, entry: Entry) -> None:
        task = asyncio.create_task(self._handle(entry), name=f"tool:{entry[0]}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _handle(self, entry: Entry) -> None:
        entry_id, fields = entry
        try:
            removal = WorkspaceRemoval.find(fields)
            if removal is not None:
                await self._handle_removal(entry_id, removal)
                return
            probe = AssetProbe.find(fields)
            if probe is not None:
                await self._handle_probe(entry_id, probe)
                return
            request = WorkspaceRequest.find(fields)
            if request is not None:
                await self._handle_workspace_request(entry_id, request)
                return
            job = ToolCallJob.from_fields(fields)
        except ValueError:
            log.error("dropping malformed tool call %s: %r", entry_id, fields)
            await self.redis.xack(self.keys.tools, TOOLS_GROUP, entry_id)
            return
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
        await self.redis.xack(self.keys.tools, TOOLS_GROUP, entry_id)

    async def _handle_removal(self, entry_id: str, removal: WorkspaceRemoval) -> None:
        try:
            await self._remove_workspace(removal.tenant_id, removal.task_id)
        except Exception:
            # Left pending: this or another runner claims it again and
            # finishes the removal.
            log.exception("could not remove the workspace of task %s", removal.task_id)
            return
        await self.redis.xack(self.keys.tools, TOOLS_GROUP, entry_id)

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
        await self.redis.xack(self.keys.tools, TOOLS_GROUP, entry_id)

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
        await self.redis.xack(self.keys.tools, TOOLS_GROUP, entry_id)

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
        """A turn ended (``<tenant_id> <task_id>``): kill what its tools left running."""
        tenant_id, _, task_id = data.partition(" ")
        if self.executor.connectors is not None:
            # Its MCP sessions too (a stdio server's process would be reaped anyway).
            await self.executor.connectors.turn_ended(tenant_id, task_id)
        killed = await reap_leftovers(self.workspaces.path(tenant_id, task_id))
        if killed:
            log.info("reaped %d leftover process group(s) of task %s", killed, task_id)
        if self.archiving is not None:
            # After the reap: nothing of the turn still writes into it.
            self.archiving.turn_ended(tenant_id, task_id)
