"""Redis client construction: one server, or a Redis Cluster (``HOLDFAST_REDIS_CLUSTER``).

Every service types its client as :class:`redis.asyncio.Redis`. In cluster mode
:func:`connect` returns a :class:`ClusterClient` instead — redis-py's asyncio
``RedisCluster`` plus the few things the engine needs that redis-py 5 leaves out
of it (see docs/reliability.md, "Redis Cluster"):

- ``pipeline(transaction=True)``: a MULTI/EXEC on the master of the commands'
  one slot (every Holdfast transaction touches one key, or one task's keys);
- ``pubsub()``: a subscription on one node of the cluster — a classic
  ``PUBLISH`` reaches every node, so any node will do;
- ``mget`` across slots: split per slot (not atomic, which no caller needs);
- riding out a failover: a command that fails because a master is gone or its
  slots are not served yet is retried for up to :data:`FAILOVER_SECONDS`;
- ``replica_reads``: the stream reads (and redis-py's own read commands) go to a
  replica of their slot, so a reader sees only what a replica has — what
  survives its master's death (the gateways' tail, docs/reliability.md).

Every client has a socket timeout and a connect timeout (:func:`timeouts`), so a
Redis that goes silent (a partition, a frozen host) is noticed instead of waited
for. redis-py counts a blocking command's wait against the socket timeout too:
each one asks Redis to block for at most :data:`BLOCK_SLICE_SECONDS`, longer
waits are made of such slices (:func:`blpop_within`), and pub/sub is read in
short polls (``holdfast_shared.pubsub``). docs/operations.md lists the timeouts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import traceback
from pathlib import PurePath
from typing import Any, cast

import redis as sync_redis
from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import Pipeline, PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.cluster import LoadBalancingStrategy
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    MasterDownError,
    OutOfMemoryError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TimeoutError,
    TryAgainError,
)

log = logging.getLogger(__name__)

# A master's death is noticed after cluster-node-timeout and its replica is
# promoted a moment later; commands wait that long rather than fail a turn.
FAILOVER_SECONDS = 15.0
_RETRY_PAUSE_SECONDS = 0.2
_FAILOVER_ERRORS = (ConnectionError, TimeoutError, ClusterDownError, SlotNotCoveredError)
# Reads of streams, which redis-py 5 does not count among its read commands.
_STREAM_READS = frozenset({"XREAD", "XRANGE", "XREVRANGE", "XLEN"})

# The longest any blocking command (XREAD/XREADGROUP BLOCK, BLPOP) asks Redis
# to wait in one call; longer waits are slices of it.
BLOCK_SLICE_SECONDS = 5.0
# How far the socket timeout stays above the longest block (or WAIT) at least:
# a reply due at the end of a block on a busy host is not taken for silence.
_BLOCK_MARGIN_SECONDS = 1.0
# Redis reads a timeout that rounds to 0 ms as "block for ever".
_SHORTEST_BLOCK_SECONDS = 0.01


def timeouts() -> tuple[float, float]:
    """The (socket, connect) timeouts of this process's Redis clients, in seconds:
    ``HOLDFAST_REDIS_SOCKET_TIMEOUT_SECONDS`` raised, if need be, to
    :data:`BLOCK_SLICE_SECONDS` or the replica ``WAIT``'s timeout plus a margin,
    and ``HOLDFAST_REDIS_CONNECT_TIMEOUT_SECONDS``."""
    from holdfast_shared.settings import get_settings

    settings = get_settings()
    longest_wait = max(BLOCK_SLICE_SECONDS, settings.redis_wait_timeout_ms / 1000)
    socket_timeout = max(
        settings.redis_socket_timeout_seconds, longest_wait + _BLOCK_MARGIN_SECONDS
    )
    return socket_timeout, settings.redis_connect_timeout_seconds


async def blpop_within(redis: Redis, keys: list[str], within: float) -> tuple[str, str] | None:
    """``BLPOP keys`` for up to ``within`` seconds, as calls of at most
    :data:`BLOCK_SLICE_SECONDS` (one long call would outlast the socket timeout):
    ``(key, value)``, or None when nothing came in time."""
    deadline = time.monotonic() + within
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        block = max(_SHORTEST_BLOCK_SECONDS, min(left, BLOCK_SLICE_SECONDS))
        # redis-py types BLPOP's timeout as int; Redis takes fractions of a second.
        got: list[str] | None = await redis.blpop(keys, timeout=block)  # type: ignore[arg-type,misc]
        if got is not None:
            return got[0], got[1]


def cluster_enabled() -> bool:
    """``HOLDFAST_REDIS_CLUSTER`` of this process."""
    from holdfast_shared.settings import get_settings

    return get_settings().redis_cluster


def is_cluster(redis: Redis) -> bool:
    """Whether ``redis`` (typed as a plain client everywhere) is a cluster client."""
    return isinstance(redis, RedisCluster)


def refused_for_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write at its ``maxmemory`` (``noeviction``):
    a command's ``OOM`` error, or a script's whose write met it."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "OOM command not allowed" in str(exc)
    )


def closed_under_redis(exc: BaseException) -> bool:
    """A redis-py connection closed under a command (its server killed, or a cluster
    client closing its nodes for a failover while another command used one): redis-py
    5 to 8.1 let the transport's ``AttributeError``/``TypeError`` out instead of a
    ConnectionError (redis/redis-py#3546, #4287; fixed after 8.1), and uvloop's
    ``RuntimeError`` ("the handler is closed"). redis-py drops the connection first,
    so the command can be sent again."""
    if not isinstance(exc, AttributeError | TypeError | RuntimeError):
        return False
    frames = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return any(
        PurePath(name).parts[-3:] == ("redis", "asyncio", "connection.py") for name in frames
    )


def _options(url: str) -> dict[str, Any]:
    socket_timeout, connect_timeout = timeouts()
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
    }
    # TCP keepalive makes no sense on a unix socket, and redis-py refuses it there.
    if not url.startswith("unix://"):
        options["socket_keepalive"] = True
    return options


def connect(
    url: str,
    *,
    max_connections: int = 200,
    cluster: bool | None = None,
    replica_reads: bool = False,
) -> Redis:
    """An asyncio client with string replies; accepts ``redis://`` and ``unix://`` URLs.

    ``cluster`` (default: ``HOLDFAST_REDIS_CLUSTER``) makes it a :class:`ClusterClient`
    on the cluster that ``url``'s node belongs to; ``max_connections`` is then per node.
    ``replica_reads`` (a cluster only): reads go to a replica of their slot while it
    has one; writes to its master, as always.
    """
    if cluster is None:
        cluster = cluster_enabled()
    if cluster:
        return cast(
            Redis,
            ClusterClient.for_url(
                url, max_connections=max_connections, replica_reads=replica_reads
            ),
        )
    client: Redis = Redis.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        health_check_interval=30,
        **_options(url),
    )
    return client


def connect_sync(url: str, *, timeout: float, cluster: bool | None = None) -> sync_redis.Redis:
    """A blocking client for threads (liveness heartbeats): bytes replies, ``timeout``
    on every socket operation. Typed as ``redis.Redis``; only single-key commands."""
    if cluster is None:
        cluster = cluster_enabled()
    if cluster:
        return cast(
            sync_redis.Redis,
            SyncRedisCluster.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout),
        )
    return sync_redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)


class ClusterClient(RedisCluster):
    """redis-py's asyncio cluster client with transactions on one slot, pub/sub,
    cross-slot MGET and retries through a failover."""

    @classmethod
    def for_url(
        cls, url: str, *, max_connections: int, replica_reads: bool = False
    ) -> ClusterClient:
        options: dict[str, Any] = {
            "decode_responses": True,
            "health_check_interval": 30,
            **_options(url),
        }
        extra: dict[str, Any] = {}
        if replica_reads:
            # Also makes every connection READONLY, which a replica needs to
            # serve reads (a master ignores it).
            extra["load_balancing_strategy"] = LoadBalancingStrategy.ROUND_ROBIN_REPLICAS
        client = cast(
            ClusterClient, cls.from_url(url, max_connections=max_connections, **options, **extra)
        )
        client._node_options = options
        client.replica_reads = replica_reads
        return client

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._node_options: dict[str, Any] = {"decode_responses": True}
        self._node_clients: dict[str, Redis] = {}
        self._pubsub_pools: dict[str, ConnectionPool] = {}
        self._pubsub_turn = itertools.count()
        self.replica_reads = False

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        target = kwargs.get("target_nodes")
        if target is not None and not self._is_node_flag(target):
            # Aimed at given nodes by the caller: no re-routing.
            return await super().execute_command(*args, **kwargs)
        deadline = asyncio.get_running_loop().time() + FAILOVER_SECONDS
        while True:
            try:
                return await super().execute_command(*args, **kwargs)
            except Exception as exc:
                if not isinstance(exc, _FAILOVER_ERRORS) and not closed_under_redis(exc):
                    raise
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                log.debug("redis cluster: %s failed (%s); retrying", args[0], exc)
                await asyncio.sleep(_RETRY_PAUSE_SECONDS)

    async def _determine_nodes(
        self, command: str, *args: Any, node_flag: str | None = None
    ) -> list[ClusterNode]:
        if self.replica_reads and not node_flag and command.upper() in _STREAM_READS:
            slot = await self._determine_slot(command, *args)
            # A replica of the slot; its master when it has none (left after a failover).
            return [
                self.nodes_manager.get_node_from_slot(
                    slot, True, LoadBalancingStrategy.ROUND_ROBIN_REPLICAS
                )
            ]
        return await super()._determine_nodes(command, *args, node_flag=node_flag)

    async def _determine_slot(self, command: str, *args: Any) -> int:
        # redis-py asks a node (COMMAND GETKEYS, a round trip) for the keys of a
        # command whose keys move; the stream reads are common and easy to parse.
        if command.upper() in ("XREAD", "XREADGROUP"):
            words = [str(a).upper() if isinstance(a, str) else "" for a in args]
            if "STREAMS" in words:
                rest = args[words.index("STREAMS") + 1 :]
                keys = rest[: len(rest) // 2]
                slots = {self.keyslot(key) for key in keys}
                if len(slots) == 1:
                    return slots.pop()
                raise RedisClusterException(f"{command}: the streams {keys} are in several slots")
        return await super()._determine_slot(command, *args)

    async def master_client(self, key: str) -> Redis:
        """A plain client of the master that serves ``key``'s slot now (cached per node):
        for what must run on one connection of that node (MULTI/EXEC, a write then WAIT)."""
        if self._initialize:
            await self.initialize()
        node = self.get_node_from_key(key)
        if node is None:  # pragma: no cover - get_node_from_key raises instead
            raise SlotNotCoveredError(f"no master serves {key!r}")
        client = self._node_clients.get(node.name)
        if client is None:
            client = self._node_clients[node.name] = Redis(
                host=node.host, port=int(node.port), **self._node_options
            )
        return client

    async def on_master(self, key: str, build: Any) -> list[Any]:
        """Run ``build(pipe)`` (queueing commands on a non-transactional pipeline of
        ``key``'s master) and execute it, again on the new master after a failover or
        a slot move. Only for commands that were not carried out when this fails: a
        MOVED reply or a refused connection."""
        deadline = asyncio.get_running_loop().time() + FAILOVER_SECONDS
        while True:
            try:
                client = await self.master_client(key)
                async with client.pipeline(transaction=False) as pipe:
                    build(pipe)
                    return await pipe.execute()
            except (*_FAILOVER_ERRORS, RedisClusterException, ResponseError) as exc:
                if isinstance(exc, ResponseError) and not _redirected(exc):
                    raise
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                await self._forget_topology()
                await asyncio.sleep(_RETRY_PAUSE_SECONDS)

    async def _forget_topology(self) -> None:
        # The next command asks the cluster which node serves which slot again.
        self._initialize = True
        clients, self._node_clients = self._node_clients, {}
        for client in clients.values():
            await client.aclose()

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> Any:
        if transaction:
            return SlotTransaction(self)
        return super().pipeline(shard_hint=shard_hint)

    def pubsub(self, **kwargs: Any) -> PubSub:
        """A subscription on one node, each call the next one: a caller that lost its
        subscription (the node died) gets another node when it subscribes again."""
        nodes = self.get_nodes() or list(self.nodes_manager.startup_nodes.values())
        node = nodes[next(self._pubsub_turn) % len(nodes)]
        pool = self._pubsub_pools.get(node.name)
        if pool is None:
            pool = self._pubsub_pools[node.name] = ConnectionPool(
                host=node.host, port=node.port, **self._node_options
            )
        return PubSub(pool, **kwargs)

    async def publish(self, channel: Any, message: Any, **kwargs: Any) -> Any:
        # A classic PUBLISH is broadcast over the cluster bus: any node reaches every
        # subscriber. (redis-py 5's asyncio cluster client has no publish of its own.)
        return await self.execute_command(
            "PUBLISH", channel, message, target_nodes=self.RANDOM, **kwargs
        )

    async def mget(self, keys: Any, *args: Any) -> Any:
        return await self.mget_nonatomic(keys, *args)

    async def aclose(self) -> None:
        # redis-py also calls this after a connection error, to learn the topology
        # again: every connection goes (and is made again on demand) — the node
        # clients' too, but not the subscriptions', which would only miss messages.
        await super().aclose()
        for client in self._node_clients.values():
            await client.aclose()


def _redirected(exc: ResponseError) -> bool:
    """Whether the node refused the command as not its to serve (now): nothing ran."""
    if isinstance(exc, AskError | TryAgainError | ClusterDownError | MasterDownError):
        return True  # MovedError is an AskError
    text = str(exc)
    return any(word in text for word in ("MOVED", "ASK ", "CLUSTERDOWN", "TRYAGAIN", "READONLY"))


class SlotTransaction(Pipeline):
    """``pipeline(transaction=True)`` on a cluster: the queued commands run in one
    MULTI/EXEC on their slot's master. Every command's first argument must be a key
    of that one slot (it is, for each transaction Holdfast makes)."""

    def __init__(self, cluster: ClusterClient) -> None:
        # Never connects: execute() hands the queued commands to the master's client.
        super().__init__(ConnectionPool(), {}, True, None)
        self.owner = cluster

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack = self.command_stack
        if not stack:
            return []
        keys = [str(args[1]) for args, _options in stack]
        if len({self.owner.keyslot(key) for key in keys}) != 1:
            self.reset_sync()
            raise RedisClusterException(
                f"a transaction in a cluster must touch one slot; it touched {keys}"
            )

        try:
            deadline = asyncio.get_running_loop().time() + FAILOVER_SECONDS
            while True:
                try:
                    client = await self.owner.master_client(keys[0])
                    async with client.pipeline(transaction=True) as pipe:
                        pipe.command_stack.extend(stack)
                        return await pipe.execute(raise_on_error)
                except (*_FAILOVER_ERRORS, RedisClusterException, ResponseError) as exc:
                    if isinstance(exc, ResponseError) and not _redirected(exc):
                        raise
                    if asyncio.get_running_loop().time() >= deadline:
                        raise
                    await self.owner._forget_topology()
                    await asyncio.sleep(_RETRY_PAUSE_SECONDS)
        finally:
            self.reset_sync()

    def reset_sync(self) -> None:
        self.command_stack = []
        self.scripts = set()
