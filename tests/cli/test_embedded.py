"""The embedded servers behind ``holdfast up`` keep their data across a stop and a start."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
import redis

from holdfast.embedded import EmbeddedPostgres, EmbeddedRedis


@pytest.mark.slow
def test_embedded_servers_keep_data_across_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    redis_server = EmbeddedRedis(data / "redis")
    postgres_server = EmbeddedPostgres(data / "postgres")
    try:
        redis_url = redis_server.start()
        database_url = postgres_server.start()
        assert redis_url.startswith("unix://")

        with redis.Redis.from_url(redis_url) as client:
            assert client.config_get("appendonly") == {"appendonly": "yes"}
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
            client.set("hfhelper:kept", "across restarts")
        with psycopg.connect(database_url) as conn:
            conn.execute("CREATE TABLE kept (note text)")
            conn.execute("INSERT INTO kept VALUES ('across restarts')")

        redis_server.stop()
        postgres_server.stop()

        assert redis_server.start() == redis_url
        assert postgres_server.start() == database_url
        with redis.Redis.from_url(redis_url) as client:
            assert client.get("hfhelper:kept") == b"across restarts"
        with psycopg.connect(database_url) as conn:
            assert conn.execute("SELECT note FROM kept").fetchall() == [("across restarts",)]
    finally:
        redis_server.stop()
        postgres_server.stop()
