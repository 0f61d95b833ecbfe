"""Find the Redis and PostgreSQL servers the tests run against.

In order: ``HOLDFAST_TEST_REDIS_URL`` / ``HOLDFAST_TEST_DATABASE_URL``; else
testcontainers when a Docker engine answers; else the embedded servers that
``holdfast up`` uses. Never a mock.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def _docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
    except Exception:
        return False
    return True


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    url = os.environ.get("HOLDFAST_TEST_REDIS_URL")
    if url:
        yield url
        return
    if _docker_available():
        from testcontainers.redis import RedisContainer

        with RedisContainer(os.environ.get("HOLDFAST_TEST_REDIS_IMAGE", "redis:7")) as c:
            yield f"redis://{c.get_container_host_ip()}:{c.get_exposed_port(6379)}/0"
        return
    from holdfast.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp / "redis")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def postgres_server(tmp: Path) -> Iterator[str]:
    """A URL of a server database we may create other databases from."""
    url = os.environ.get("HOLDFAST_TEST_DATABASE_URL")
    if url:
        yield url
        return
    if _docker_available():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer(
            os.environ.get("HOLDFAST_TEST_POSTGRES_IMAGE", "pgvector/pgvector:pg16"),
            driver=None,
        ) as c:
            yield c.get_connection_url()
        return
    from holdfast.embedded import EmbeddedPostgres

    server = EmbeddedPostgres(tmp / "postgres")
    server.start()
    try:
        yield server.admin_url
    finally:
        server.stop()
