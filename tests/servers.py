"""Find the Redis and PostgreSQL servers the tests run against. Never a mock.

``HOLDFAST_TEST_SERVERS`` chooses how:

* ``auto`` (the default): ``HOLDFAST_TEST_REDIS_URL`` / ``HOLDFAST_TEST_DATABASE_URL``
  when set; else testcontainers when a Docker engine answers and has (or can
  pull) every image it needs; else the embedded servers that ``holdfast up``
  uses. Docker is asked once per run, and a machine without it or without the
  images falls back to the embedded servers in well under a second (plus one
  failed pull, when an engine answers but has no image).
* ``embedded``: the embedded servers, whatever is set or running. ``.ci/run``
  uses it to test the fresh-machine path on a machine that has servers.
* ``testcontainers``: testcontainers; an error when Docker or an image is missing.

The images are ``HOLDFAST_TEST_REDIS_IMAGE`` (``redis:7``) and
``HOLDFAST_TEST_POSTGRES_IMAGE`` (``pgvector/pgvector:pg16``), plus
testcontainers' Ryuk unless ``TESTCONTAINERS_RYUK_DISABLED`` is set.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

MODES = ("auto", "embedded", "testcontainers")
DOCKER_TIMEOUT_SECONDS = 5
# A pull reports progress continuously; this long without a word means it is stuck.
PULL_TIMEOUT_SECONDS = 120

Kind = Literal["url", "testcontainers", "embedded"]


def _mode() -> str:
    mode = os.environ.get("HOLDFAST_TEST_SERVERS", "").strip().lower() or "auto"
    if mode not in MODES:
        raise RuntimeError(f"HOLDFAST_TEST_SERVERS={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def _redis_image() -> str:
    return os.environ.get("HOLDFAST_TEST_REDIS_IMAGE", "redis:7")


def _postgres_image() -> str:
    return os.environ.get("HOLDFAST_TEST_POSTGRES_IMAGE", "pgvector/pgvector:pg16")


def _unix_socket_answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(DOCKER_TIMEOUT_SECONDS)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def docker_unusable(images: Sequence[str]) -> str | None:
    """Why testcontainers cannot run ``images`` here, or None when it can.

    Pulls the images that are missing. Every connection it opens is closed
    before it returns, whatever the outcome.
    """
    try:
        import docker
        import docker.constants
        import docker.errors
    except ImportError:
        return "the docker package is not installed"
    # docker-py leaves the socket of a failed connection to a unix socket open
    # (docker/docker-py#3356), and it connects in its constructor unless given
    # an API version: a ResourceWarning at some later garbage collection, an
    # error under ``filterwarnings = error``. So first find the engine's socket
    # without connecting, and look for a listener there ourselves.
    try:
        offline = docker.from_env(version=docker.constants.DEFAULT_DOCKER_API_VERSION)
    except Exception as e:  # a DOCKER_HOST or context it cannot parse, ssh without paramiko
        return f"Docker is not configured here ({e})"
    try:
        socket_path = getattr(offline.api.get_adapter(offline.api.base_url), "socket_path", None)
    finally:
        offline.close()
    if socket_path is not None and not _unix_socket_answers(socket_path):
        return f"no Docker engine listens on {socket_path}"
    try:
        client = docker.from_env(timeout=DOCKER_TIMEOUT_SECONDS)
    except Exception as e:
        return f"the Docker engine does not answer ({e})"
    try:
        client.ping()
        for image in images:
            try:
                client.images.get(image)
                continue
            except docker.errors.ImageNotFound:
                pass
            log.info("pulling %s", image)
            client.api.timeout = PULL_TIMEOUT_SECONDS
            try:
                client.images.pull(image)
            except Exception as e:
                return f"the image {image} is not here and cannot be pulled ({e})"
            finally:
                client.api.timeout = DOCKER_TIMEOUT_SECONDS
    except Exception as e:
        return f"the Docker engine does not answer ({e})"
    finally:
        client.close()
    return None


@functools.cache
def _testcontainers_unusable() -> str | None:
    """Asked once per run, for both servers: they run the same way or not at all."""
    images = [_redis_image(), _postgres_image()]
    try:
        from testcontainers.core.config import testcontainers_config
    except ImportError:
        return "testcontainers is not installed"
    if not testcontainers_config.ryuk_disabled:
        images.append(testcontainers_config.ryuk_image)
    return docker_unusable(images)


def server_kind(url_variable: str) -> Kind:
    """Where the server whose URL ``url_variable`` may hold comes from."""
    mode = _mode()
    if mode == "embedded":
        return "embedded"
    if mode == "auto" and os.environ.get(url_variable):
        return "url"
    reason = _testcontainers_unusable()
    if reason is None:
        return "testcontainers"
    if mode == "testcontainers":
        raise RuntimeError(f"HOLDFAST_TEST_SERVERS=testcontainers, but {reason}")
    log.warning("testcontainers cannot run here (%s); using the embedded servers", reason)
    return "embedded"


@contextlib.contextmanager
def redis_server(tmp: Path) -> Iterator[str]:
    kind = server_kind("HOLDFAST_TEST_REDIS_URL")
    if kind == "url":
        yield os.environ["HOLDFAST_TEST_REDIS_URL"]
        return
    if kind == "testcontainers":
        from testcontainers.redis import RedisContainer

        with RedisContainer(_redis_image()) as c:
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
    kind = server_kind("HOLDFAST_TEST_DATABASE_URL")
    if kind == "url":
        yield os.environ["HOLDFAST_TEST_DATABASE_URL"]
        return
    if kind == "testcontainers":
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer(_postgres_image(), driver=None) as c:
            yield c.get_connection_url()
        return
    from holdfast.embedded import EmbeddedPostgres

    server = EmbeddedPostgres(tmp / "postgres")
    server.start()
    try:
        yield server.admin_url
    finally:
        server.stop()
