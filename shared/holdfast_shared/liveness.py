"""Who is alive: loop-workers, tool-runners, the providers the workers serve, and
taking over the work of a process that died.

**Registrations.** Each tool-runner keeps ``Keys.runner_alive(id)`` (short TTL,
its sandbox probe as JSON) and its id in ``Keys.runners`` (scored by when that
lapses). Others read the first to tell a dead runner's calls; ``GET /health``
lists the second. Each loop-worker keeps ``Keys.worker_alive(id)`` (short TTL,
the providers it serves as JSON) while it lives, and deletes it when it stops
cleanly; a killed worker's key lapses within its TTL (``HOLDFAST_LIVENESS_SECONDS``,
refreshed by a :class:`Heartbeat` thread), and the others take its turns over
(below). The same step advertises its providers first, so a worker whose key
exists is one the gateway already routes turns to. Readers: whoever must know
that a given worker is up, such as ``holdfast.testing``'s readiness rule.

**Availability.** Each loop-worker advertises the providers it has keys for in
``Keys.providers`` (a sorted set scored by an expiry time) and refreshes it
while it lives, together with its own registration (:func:`announce_worker`);
the gateway refuses a request for a provider no live worker advertises with a
422, instead of accepting a turn that can only fail. A model a worker cannot
serve (its context window too small even for the trimmed system prompt and
tools) is advertised in ``Keys.unavailable_models`` with the reason: the
gateway refuses it the same way, and ``GET /health`` is degraded and says why.

**Taking over a dead consumer's stream entries**, as soon as its liveness key
lapses. Loop-workers and tool-runners name their consumer in the group after
the id of their liveness key (refreshed four times per TTL by a
:class:`Heartbeat` thread). A process killed with SIGKILL stops refreshing it,
so within one TTL its key is gone; every live consumer looks at the group's
pending entries every eighth of a TTL (``XPENDING``, one cheap summary) and
claims the entries of consumers without a key. That takes over a dead
process's work within about one TTL instead of waiting for the entries to sit
idle for a whole lease.

Safety does not rest on this being right. A process that was only paused
(SIGSTOP, a long GC, a slow host) and loses its entries this way is fenced
where it matters: a loop-worker's appends carry the turn's epoch, which the
new owner bumps; a tool call is claimed once in PostgreSQL by
``tool_call_id``, and a redelivered one is answered from that record, never
run twice.

Two live consumers may both see the same dead one; ``XCLAIM``'s
``min_idle_time`` makes one of them win: the first claim resets the entries'
idle time, so the second finds nothing idle enough. The guard is half a TTL,
which a dead consumer's entries have always passed by the time its key lapsed
(its last renewal came before its last refresh).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import StreamIdT

from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import connect_sync, is_cluster

log = logging.getLogger(__name__)

ALIVE_TTL_SECONDS = 6
ADVERTISE_SECONDS = 30
# Entries claimed per dead consumer per pass: the rest follow on the next pass.
_MAX_PER_PASS = 100


# Registrations


async def announce_runner(
    redis: Redis,
    keys: Keys,
    runner_id: str,
    sandbox: dict[str, Any],
    *,
    ttl_seconds: float = ALIVE_TTL_SECONDS,
) -> None:
    """Say (again) that ``runner_id`` lives, with what its sandbox can do.

    ``ttl_seconds`` (``HOLDFAST_LIVENESS_SECONDS`` in a runner) is also how soon its
    calls in flight are taken over and reported interrupted once it stops
    (:func:`claim_from_dead`)."""
    expires = int((time.time() + ttl_seconds) * 1000)
    # Two slots in a Redis Cluster, where a MULTI cannot span them; neither order
    # matters to readers (live_runners skips an id whose key is missing).
    async with redis.pipeline(transaction=not is_cluster(redis)) as pipe:
        pipe.set(keys.runner_alive(runner_id), json.dumps(sandbox), px=int(ttl_seconds * 1000))
        pipe.zadd(keys.runners, {runner_id: expires})
        await pipe.execute()


async def withdraw_runner(redis: Redis, keys: Keys, runner_id: str) -> None:
    async with redis.pipeline(transaction=not is_cluster(redis)) as pipe:
        pipe.delete(keys.runner_alive(runner_id))
        pipe.zrem(keys.runners, runner_id)
        await pipe.execute()


async def live_runners(redis: Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    """Every live tool-runner's sandbox report, by runner id."""
    now = int(time.time() * 1000)
    await redis.zremrangebyscore(keys.runners, "-inf", now)
    ids = [str(i) for i in await redis.zrange(keys.runners, 0, -1)]
    if not ids:
        return {}
    reports = await redis.mget([keys.runner_alive(i) for i in ids])
    out: dict[str, dict[str, Any]] = {}
    for runner_id, raw in zip(ids, reports, strict=True):
        if raw is None:
            continue
        try:
            report = json.loads(raw)
        except ValueError:
            report = {}
        out[runner_id] = report if isinstance(report, dict) else {}
    return out


async def announce_worker(
    redis: Redis,
    keys: Keys,
    worker_id: str,
    providers: Collection[str],
    *,
    default_model: str | None = None,
    ttl_seconds: float = ALIVE_TTL_SECONDS,
    unavailable: Mapping[str, str] | None = None,
) -> None:
    """Say (again) that ``worker_id`` lives and serves ``providers`` (but not
    the models of ``unavailable``, ``provider:model`` → why).

    ``ttl_seconds`` (``HOLDFAST_LIVENESS_SECONDS`` in a worker) is also how soon the
    other workers take its turns over once it stops saying so (:func:`claim_from_dead`)."""
    await advertise(redis, keys, providers, default_model=default_model)
    if unavailable:
        expires = int((time.time() + ADVERTISE_SECONDS) * 1000)
        members = {json.dumps([spec, why]): expires for spec, why in unavailable.items()}
        await redis.zadd(keys.unavailable_models, members, gt=True)
    report = json.dumps({"providers": sorted(providers)})
    await redis.set(keys.worker_alive(worker_id), report, px=int(ttl_seconds * 1000))


async def withdraw_worker(redis: Redis, keys: Keys, worker_id: str) -> None:
    """Say that ``worker_id`` has stopped (its providers lapse on their own)."""
    await redis.delete(keys.worker_alive(worker_id))


# Availability


async def advertise(
    redis: Redis, keys: Keys, providers: Iterable[str], *, default_model: str | None = None
) -> None:
    """Say (again) that a live worker serves ``providers``, and which model it
    runs when a turn names none (the gateway checks a message's media against it)."""
    expires = int((time.time() + ADVERTISE_SECONDS) * 1000)
    await redis.zadd(keys.providers, {name: expires for name in providers}, gt=True)
    if default_model is not None:
        await redis.zadd(keys.default_models, {default_model: expires}, gt=True)


async def available_providers(redis: Redis, keys: Keys) -> set[str]:
    now = int(time.time() * 1000)
    names = await redis.zrangebyscore(keys.providers, now, "+inf")
    return {str(name) for name in names}


async def unavailable_models(redis: Redis, keys: Keys) -> dict[str, str]:
    """``provider:model`` → why, for each model some live worker cannot serve."""
    now = int(time.time() * 1000)
    found: dict[str, str] = {}
    for member in await redis.zrangebyscore(keys.unavailable_models, now, "+inf"):
        try:
            spec, why = json.loads(member)
        except (ValueError, TypeError):
            continue
        found[str(spec)] = str(why)
    return found


async def default_models(redis: Redis, keys: Keys) -> set[str]:
    """The default ``provider:model`` of every live worker (usually one)."""
    now = int(time.time() * 1000)
    specs = await redis.zrangebyscore(keys.default_models, now, "+inf")
    return {str(spec) for spec in specs}


# Taking over the work of the dead


def refresh_every(liveness_seconds: float) -> float:
    """How often a process refreshes its liveness key."""
    return liveness_seconds / 4


def scan_every(liveness_seconds: float) -> float:
    """How often a live process looks for dead ones: the takeover waits for the key to
    lapse (up to one TTL after the death) plus up to one scan."""
    return liveness_seconds / 8


class Heartbeat:
    """Keeps a liveness key alive from a thread of its own, on its own connection.

    The process's event loop may stall for a second or two under load (a CPU-bound
    step, a starved host) without being dead: refreshed from the loop, its key would
    lapse and its work be taken over for nothing. The thread keeps beating through
    such stalls, and stops only with the process — SIGKILL, or SIGSTOP, which stops
    every thread (and then fencing protects the work that moved).
    """

    def __init__(self, url: str, key: str, value: str, *, ttl_seconds: float) -> None:
        self.key = key
        self.value = value
        self.ttl_ms = int(ttl_seconds * 1000)
        self.interval = refresh_every(ttl_seconds)
        timeout = max(0.2, self.interval)
        self._client = connect_sync(url, timeout=timeout)
        self._stopping = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {key}", daemon=True)

    def start(self) -> None:
        """Beat now (the key exists before the process takes any work), then keep beating."""
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and delete the key: the process's work is free at once. Blocks for
        up to one interval (call it from a thread in async code)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self._client.delete(self.key)
        except RedisError:
            pass  # unreachable: the key lapses on its own
        finally:
            self._client.close()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            self._beat()

    def _beat(self) -> None:
        try:
            self._client.set(self.key, self.value, px=self.ttl_ms)
        except RedisError as exc:
            if not self._failing:  # once per outage, not four times a second
                log.warning("could not refresh the liveness key %s: %s", self.key, exc)
            self._failing = True
        else:
            self._failing = False


async def dead_consumers(
    redis: Redis,
    stream: str,
    group: str,
    me: str,
    alive_key: Callable[[str], str],
) -> list[str]:
    """Consumers of ``group`` with pending entries whose liveness key is gone (never ``me``)."""
    summary: dict[str, Any] = await redis.xpending(stream, group)
    others = [str(c["name"]) for c in summary.get("consumers") or [] if str(c["name"]) != me]
    if not others:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for name in others:
            pipe.exists(alive_key(name))
        alive = await pipe.execute()
    return [name for name, present in zip(others, alive, strict=True) if not present]


async def claim_from_dead(
    redis: Redis,
    stream: str,
    group: str,
    me: str,
    alive_key: Callable[[str], str],
    *,
    liveness_seconds: float,
    count: int,
) -> list[tuple[str, str, dict[str, str]]]:
    """Claim up to ``count`` pending entries of dead consumers for ``me``.

    Returns ``(dead consumer, entry id, fields)`` for each entry this call won.
    """
    if count <= 0:
        return []
    guard_ms = int(liveness_seconds * 500)
    claimed: list[tuple[str, str, dict[str, str]]] = []
    for dead in await dead_consumers(redis, stream, group, me, alive_key):
        want = min(count - len(claimed), _MAX_PER_PASS)
        if want <= 0:
            break
        pending = await redis.xpending_range(
            stream, group, min="-", max="+", count=want, consumername=dead, idle=guard_ms
        )
        ids: list[StreamIdT] = [str(p["message_id"]) for p in pending]
        if not ids:
            continue
        entries = await redis.xclaim(stream, group, me, min_idle_time=guard_ms, message_ids=ids)
        # Entries deleted from the stream meanwhile come back empty (or not at all).
        claimed += [(dead, str(e[0]), dict(e[1])) for e in entries if e and e[0] and e[1]]
    return claimed
