"""A database of its own for a test module that runs engines of its own.

Engines on one database take each other's work. Their sweeps look at every
turn in the database, whatever Redis prefix queued it: a stale turn is
queued again and a waiting message is started on the sweeping engine's
streams, where the engine that owns the task never sees it. The session
engine beside a module's engines would take turns left stale by a SIGKILL
(its lease is older than the sweep's limit), and the turns a module's engines
leave behind would be run by the next engine. So a module that starts
engines gets a fresh database, and the session's keys in it.

A module uses it by importing the fixtures, which override the session's
``database_url`` and ``api_keys``::

    from tests.isolation import own_api_keys, own_database_url  # noqa: F401

It must not also use the session's ``engine``: that one lives on the
session's database.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import pytest

from holdfast.testing import add_api_key, create_database, drop_database

RUN_ID = secrets.token_hex(4)
API_KEY = f"hf_test_{secrets.token_hex(16)}"
OTHER_KEY = f"hf_other_{secrets.token_hex(16)}"


def module_database(postgres_url: str, module: str) -> Iterator[str]:
    """A fresh, migrated database named after ``module``, dropped afterwards."""
    tail = re.sub(r"[^a-z0-9]+", "_", module.lower().rsplit(".", 1)[-1])
    name = f"hftest_{RUN_ID}_{tail}"[:63]
    url = create_database(postgres_url, name)
    try:
        yield url
    finally:
        drop_database(postgres_url, name)


def session_keys(database_url: str) -> dict[str, str]:
    """The session's two tenants and keys, registered in ``database_url``."""
    add_api_key(database_url, "tenant-main", API_KEY)
    add_api_key(database_url, "tenant-other", OTHER_KEY)
    return {"main": API_KEY, "other": OTHER_KEY}


@pytest.fixture(scope="module", name="database_url")
def own_database_url(postgres_url: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """This module's own database."""
    yield from module_database(postgres_url, request.module.__name__)


@pytest.fixture(scope="module", name="api_keys")
def own_api_keys(database_url: str) -> dict[str, str]:
    """The session's keys (``main`` and ``other``) in this module's database."""
    return session_keys(database_url)


@pytest.fixture(name="tenant_keys")
def fresh_tenant_keys(database_url: str) -> dict[str, str]:
    """Two tenants of this test alone, ``main`` and ``other``, with a key each.

    The session's tenants share their brains with every test of the run (a
    chat test's "hello" is learned into ``tenant-main``'s); a test that needs
    a tenant's memory empty, or asserts what another tenant does not find,
    takes these. Use with the session's engine (its database)::

        from tests.isolation import fresh_tenant_keys  # noqa: F401
    """
    tag = secrets.token_hex(4)
    return {
        "main": add_api_key(database_url, f"tenant-{tag}"),
        "other": add_api_key(database_url, f"tenant-{tag}-other"),
    }
