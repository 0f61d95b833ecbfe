"""Consume tool calls from ``Keys.tools`` through the ``tool-runners`` group.

Calls run concurrently (up to ``concurrency``) so a long command never holds
up another task's call. A call is acknowledged after its outcome is stored
and sent; a runner that dies leaves it pending, and another runner claims it
after ``claim_idle_ms`` — where the executor's idempotency record makes sure
it is answered, never run twice. Asset Directory probes (list a server's tools)
come on the same stream and are answered on the gateway's reply list. Turn-end
reap requests (which also close the task's MCP sessions) arrive on a pub/sub
channel, since every runner may hold processes of that task.
"""

from __future__ import annotations

import asyncio
import logging

from holdfast_shared.background import Background
from holdfast_shared.jobs import AssetProbe, AssetProbeResult, ToolCallJob, WorkspaceRemoval
from holdfast_shared.keys import TOOLS_GROUP, Keys
from holdfast_shared.pubsub import listen
from holdfast_shared.streams import ensure_group
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

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
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.executor = executor
        self.workspaces = workspaces
        self.consumer_name = consumer_name
        self.concurrency = concurrency
        self.claim_idle_ms = claim_idle_ms
        self._running: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        await ensure_group(self.redis, self.keys.tools, TOOLS_GROUP)
        try:
            async with Background() as background:
                background.start(
                    listen(self.redis, self.keys.tools_reap, self._reap, what="reap requests"),
                    name="reap-requests",
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

    async def _remove_workspace(self, tenant_id: str, task_id: str) -> None:
        if self.executor.connectors is not None:
            await self.executor.connectors.task_removed(tenant_id, task_id)
        # Its processes first, so none still writes into it while it goes.
        await reap_leftovers(self.workspaces.path(tenant_id, task_id))
        removed = await asyncio.to_thread(self.workspaces.remove, tenant_id, task_id)
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
