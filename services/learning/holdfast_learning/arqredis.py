"""arq's Redis client: on one Redis server arq connects itself (``RedisSettings``);
on a Redis Cluster it gets a client of the master that serves its slot.

arq (0.28) runs MULTI/EXEC transactions over its keys on a plain client, which a
cluster takes only on one connection to the master of the one slot they all
hash to. ``Keys.learning_queue`` and ``Keys.learning_job`` put every key arq
makes for the learning service in the slot of arq's global ``arq:abort``; this
finds that slot's master. After a failover that client's master is gone, and
``main.serve`` builds arq's worker again with a new one.
"""

from __future__ import annotations

from typing import cast

from arq.connections import ArqRedis
from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import ClusterClient, connect
from holdfast_shared.settings import Settings


async def arq_pool(settings: Settings) -> ArqRedis | None:
    """arq's client of the cluster's master for its slot; None on one Redis server."""
    if not settings.redis_cluster:
        return None
    redis_url, _ = settings.require_urls()
    cluster = cast(ClusterClient, connect(redis_url, max_connections=2, cluster=True))
    try:
        queue = Keys(settings.redis_prefix).learning_queue(cluster=True)
        master = await cluster.master_client(queue)
        where = master.connection_pool.connection_kwargs
        # arq reads raw bytes (it decodes job ids itself): not decode_responses.
        return ArqRedis(host=where["host"], port=where["port"], socket_keepalive=True)
    finally:
        await cluster.aclose()
