"""The cluster client's additions to redis-py (``holdfast_shared.redisconn``), and WAIT."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import redis as sync_redis
from holdfast_shared.eventlog import EventLog
from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import ClusterClient
from redis.asyncio import Redis
from redis.exceptions import RedisClusterException
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing.cluster import RedisClusterServers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


async def test_a_transaction_runs_on_its_slots_master_and_refuses_two_slots(redis: Redis) -> None:
    tag = secrets.token_hex(4)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.rpush(f"t:{{{tag}}}:a", "x")
        pipe.expire(f"t:{{{tag}}}:a", 60)
        assert await pipe.execute() == [1, True]
    with pytest.raises(RedisClusterException, match="one slot"):
        async with redis.pipeline(transaction=True) as pipe:
            pipe.set(f"t:{{{tag}}}:b", "1")
            pipe.set(f"t:{{{tag}x}}:c", "1")
            await pipe.execute()
    assert await redis.exists(f"t:{{{tag}}}:b") == 0, "nothing of a refused transaction ran"


async def test_mget_across_slots_and_pubsub_on_a_node(redis: Redis) -> None:
    keys = [f"m:{secrets.token_hex(4)}" for _ in range(6)]
    assert isinstance(redis, ClusterClient)
    assert len({redis.keyslot(k) for k in keys}) > 1
    await redis.set(keys[0], "first")
    assert await redis.mget(keys) == ["first", None, None, None, None, None]

    channel = f"ch:{secrets.token_hex(4)}"
    pubsub = redis.pubsub()
    try:
        await pubsub.subscribe(channel)
        assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"
        await redis.publish(channel, "hello")  # from whichever node: broadcast
        for _ in range(20):
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message:
                break
        assert message is not None and message["data"] == "hello"
    finally:
        await pubsub.aclose()


async def test_wait_replicas_means_the_replica_has_the_event_when_append_returns(
    redis: Redis,
    sessions: async_sessionmaker[AsyncSession],
    redis_cluster: RedisClusterServers,
    redis_prefix: str,
) -> None:
    keys = Keys(f"{redis_prefix}wait:")
    log = EventLog(redis, sessions, keys, hot_ttl_seconds=60, wait_replicas=1)
    task_id = f"tk_{secrets.token_hex(6)}"
    bodies = [("text_delta", '{"type":"text_delta","text":"x"}')] * 3
    appended = await log.append_bodies(task_id, None, bodies, name="n", new_task=True)
    assert appended.last_seq == 3
    # The replica of the master serving the task, read directly right after.
    assert isinstance(redis, ClusterClient)
    replica = redis.get_node_from_key(keys.events(task_id), replica=True)
    assert replica is not None
    client = sync_redis.Redis(host=replica.host, port=int(replica.port), socket_timeout=2)
    try:
        client.execute_command("READONLY")
        entries = await asyncio.to_thread(client.xrange, keys.events(task_id))
    finally:
        client.close()
    assert [e[0] for e in entries] == [b"1-0", b"2-0", b"3-0"]
    assert await redis.zscore(keys.archive_dirty, task_id) == 1
