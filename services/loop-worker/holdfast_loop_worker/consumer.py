"""Consume turn jobs from ``Keys.turns`` through the ``loop-workers`` group.

Each job runs as its own asyncio task, up to ``worker_concurrency`` at once,
and is acknowledged once its turn ended, parked or was handed back.

Keeping turns alive through failures:

* lease — every ``lease/3`` s the worker renews the PostgreSQL leases of its
  turns and resets the idle time of their stream entries (``XCLAIM …
  JUSTID``); a dead worker does neither, so after ``HOLDFAST_LEASE_SECONDS``
  its entries are taken over with ``XAUTOCLAIM`` by any live worker, which
  continues the turn from its snapshot;
* liveness — sooner than that, every live worker looks for consumers of the
  group whose liveness key (``Keys.worker_alive``, TTL
  ``HOLDFAST_LIVENESS_SECONDS``) lapsed, claims their entries, ends their
  leases and continues their turns (``holdfast_shared.liveness``): a SIGKILLed
  worker's turns move within about one liveness TTL; the epoch fences a
  worker that was only paused;
* cancel — ``POST /execute/cancel`` publishes on ``Keys.cancels``; the worker
  running the turn cancels it at once;
* drain — on SIGTERM no new job is taken; running turns get
  ``HOLDFAST_DRAIN_SECONDS`` to finish, the rest are snapshotted and queued
  again for another worker;
* Redis loss — when the turns group is missing (Redis restarted empty) it is
  recreated and every unfinished turn whose lease ran out is queued again
  from PostgreSQL (``recovery.py``).

Reading, taking over and acknowledging entries, and recreating the group, are
``holdfast_shared.consuming``'s (the same for every consumer); the leases, the
rescue of dead workers' turns and the drain are this module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from holdfast_shared.background import Background, every
from holdfast_shared.consuming import Delivery, GroupConsumer, consume
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import TURNS_GROUP, Keys
from holdfast_shared.liveness import scan_every
from holdfast_shared.observability.scopes import observed_turn
from holdfast_shared.pubsub import listen
from redis.asyncio import Redis

from holdfast_loop_worker.executions import interrupt_for_pause
from holdfast_loop_worker.lease import Leases
from holdfast_loop_worker.transient import store_unreachable
from holdfast_loop_worker.turn import TurnContext, TurnRunner

log = logging.getLogger(__name__)

# XAUTOCLAIM calls per read that scan on for entries idle past the lease.
_CLAIM_CALLS_PER_READ = 4


class _Running:
    def __init__(self, entry_id: str, runner: TurnRunner, task: asyncio.Task[None]) -> None:
        self.entry_id = entry_id
        self.runner = runner
        self.task = task


class TurnConsumer:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        ctx: TurnContext,
        leases: Leases,
        *,
        consumer_name: str,
        concurrency: int,
        lease_seconds: int,
        drain_seconds: float,
        on_group_created: Callable[[], Awaitable[None]],
        liveness_seconds: float = 2.0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.ctx = ctx
        self.leases = leases
        self.consumer_name = consumer_name
        self.concurrency = concurrency
        self.lease_ms = lease_seconds * 1000
        self.drain_seconds = drain_seconds
        self.liveness_seconds = liveness_seconds
        # An entry its worker stopped renewing for a lease is taken over.
        self.group = GroupConsumer(
            redis,
            keys.turns,
            TURNS_GROUP,
            consumer_name,
            claim_idle_ms=self.lease_ms,
            claim_calls=_CLAIM_CALLS_PER_READ,
            on_group_created=on_group_created,
        )
        self._running: dict[str, _Running] = {}  # by turn id
        self._deferred: set[asyncio.Task[None]] = set()  # resume jobs waiting for a run
        self._stopping = False

    async def run(self, stop: asyncio.Event) -> None:
        """Take jobs until ``stop`` is set, then drain and hand back."""
        await self.group.ensure_group()
        try:
            async with Background() as background:
                background.start(
                    every(self.lease_ms / 3000, self._renew, what="lease renewal", wait_first=True),
                    name="lease-renewal",
                )
                background.start(
                    listen(self.redis, self.keys.cancels, self._cancel, what="cancels"),
                    name="cancels",
                )
                background.start(
                    listen(self.redis, self.keys.pauses, self._pause, what="pauses"),
                    name="pauses",
                )
                background.start(
                    every(
                        scan_every(self.liveness_seconds),
                        self._rescue,
                        what="taking over dead workers' turns",
                        wait_first=True,
                    ),
                    name="dead-workers",
                )
                await consume(
                    self.group,
                    stop,
                    self._start,
                    lambda: [r.task for r in self._running.values()],
                    concurrency=self.concurrency,
                )
                self._stopping = True
                await self._drain()
        finally:
            for later in list(self._deferred):  # their entries stay pending
                later.cancel()

    # -- running ---------------------------------------------------------------
    async def _start(self, delivery: Delivery) -> None:
        entry_id, fields = delivery.entry_id, delivery.fields
        try:
            job = TurnJob.from_fields(fields)
        except ValueError:
            log.error("dropping malformed turn job %s: %r", entry_id, fields)
            await self.group.ack(entry_id)
            return
        running = self._running.get(job.turn_id)
        if running is not None and job.resume:
            # A resume job (a HITL answer, a hand-back) for a turn still ending here,
            # say parking: dropping it would lose the answer. Run it once this run is
            # over; it then finds the turn as that run left it.
            later = asyncio.create_task(self._start_after(running.task, delivery))
            self._deferred.add(later)
            later.add_done_callback(self._deferred.discard)
            return
        if running is not None:
            # Already running here (a duplicate delivery): its own entry is
            # acknowledged when it ends; this one carries nothing more.
            await self.group.ack(entry_id)
            return
        # Taken over: its worker died or stopped renewing it.
        reason = "worker_lost" if delivery.taken_over else None
        resume_reason = reason or ("resumed" if job.resume else None)
        runner = TurnRunner(self.ctx, job, resume_reason=resume_reason)
        task = asyncio.create_task(self._handle(entry_id, job, runner), name=f"turn:{job.turn_id}")
        runner.stop.bind(task)
        self._running[job.turn_id] = _Running(entry_id, runner, task)
        task.add_done_callback(lambda _: self._running.pop(job.turn_id, None))

    async def _start_after(self, running: asyncio.Task[None], delivery: Delivery) -> None:
        await asyncio.wait([running])
        if not self._stopping:  # else it stays pending, for another worker to take
            await self._start(delivery)

    async def _handle(self, entry_id: str, job: TurnJob, runner: TurnRunner) -> None:
        try:
            outcome = await observed_turn(job, runner.run)
        except asyncio.CancelledError:
            return  # shutting down without a hand-back: the entry stays pending
        except Exception as exc:
            # Left unacknowledged: the job stays pending and is taken over, at
            # once since the lease is given up (if PostgreSQL still answers).
            store = store_unreachable(exc)
            if store is not None:
                log.warning("turn %s paused while %s is unreachable", job.turn_id, store)
            else:
                log.exception("turn %s could not be run", job.turn_id)
            with contextlib.suppress(Exception):
                await self.leases.release(job.turn_id)
            return
        log.info("turn %s of task %s: %s", job.turn_id, job.task_id, outcome)
        if outcome in ("superseded", "busy"):
            # Left pending: taken over again if its holder goes away.
            return
        await self.group.ack(entry_id)

    async def _drain(self) -> None:
        if not self._running:
            return
        log.info("draining %d turn(s) for up to %gs", len(self._running), self.drain_seconds)
        tasks = [r.task for r in self._running.values()]
        _done, pending = await asyncio.wait(tasks, timeout=self.drain_seconds)
        for running in list(self._running.values()):
            if running.task in pending:
                running.runner.stop.request("handoff")
        if pending:
            await asyncio.wait(pending, timeout=10)

    # -- background duties -------------------------------------------------------
    async def _renew(self) -> None:
        """Keep the running turns' leases and stream entries ours (every lease/3)."""
        running = list(self._running.values())
        if not running:
            return
        await self.leases.renew(self._running.keys())
        await self.redis.xclaim(
            self.keys.turns,
            TURNS_GROUP,
            self.consumer_name,
            min_idle_time=0,
            message_ids=[r.entry_id for r in running],
            justid=True,
        )

    async def _rescue(self) -> None:
        """Continue the turns of workers whose liveness key lapsed (killed, or stalled)."""
        free = self.concurrency - len(self._running)
        if self._stopping or free <= 0:
            return
        claimed = await self.group.take_from_dead(
            self.keys.worker_alive, liveness_seconds=self.liveness_seconds, count=free
        )
        if not claimed:
            return
        held: dict[str, list[str]] = {}
        for dead, delivery in claimed:
            with contextlib.suppress(ValueError):  # _start drops a malformed job
                held.setdefault(dead, []).append(TurnJob.from_fields(delivery.fields).turn_id)
        for dead, turn_ids in held.items():
            log.warning("worker %s is gone; taking over %d turn(s)", dead, len(turn_ids))
            try:
                # Before running them: their leases would otherwise hold them a lease more.
                await self.leases.revoke(dead, turn_ids)
            except Exception:
                # Started anyway: each waits for its lease (busy), then XAUTOCLAIM.
                log.warning("could not end the leases of worker %s", dead, exc_info=True)
        for _dead, delivery in claimed:
            await self._start(delivery)

    async def _pause(self, data: str) -> None:
        """An execution's pause (``<task_id> <turn_id>``): cut its model call short if
        it streams one here (else it parks at its next step boundary anyway)."""
        _task_id, _, turn_id = data.partition(" ")
        running = self._running.get(turn_id)
        if running is not None:
            interrupt_for_pause(running.runner)

    async def _cancel(self, data: str) -> None:
        """``POST /execute/cancel`` (``<task_id> <turn_id>``): stop the turn if it runs here."""
        _task_id, _, turn_id = data.partition(" ")
        running = self._running.get(turn_id)
        if running is not None and running.runner.stop.request("cancel"):
            log.info("cancelling turn %s", turn_id)
