"""Which failures of the stores are passing states, not a turn's end.

A Redis that restarts refuses connections, then answers LOADING while it
reads its file; a PostgreSQL that restarts drops its connections, then
answers "the database system is starting up". A turn that meets one is left
as a crash leaves it (its job pending, its lease lapsing) and resumes from
its last snapshot once the store answers, instead of ending ``errored``.

An error the server raised about the statement itself (a constraint, a full
disk, a bug) is not transient: running the step again would meet it again.
"""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

# SQLSTATEs of a connection that broke or a server that is going down or
# coming up: class 08 (connection exception), admin/crash shutdown, cannot
# connect now.
_POSTGRES_PASSING = ("08", "57P01", "57P02", "57P03")


def store_unreachable(exc: BaseException) -> str | None:
    """``"Redis"`` or ``"PostgreSQL"`` when ``exc`` says that store is unreachable
    for now (BusyLoadingError is a ConnectionError), else None."""
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return "Redis"
    if not isinstance(exc, DBAPIError):
        return None
    if exc.connection_invalidated:
        return "PostgreSQL"
    state = getattr(exc.orig, "sqlstate", None)
    if state is None:
        # Raised by the driver, not the server: it could not connect or lost the
        # connection mid-statement.
        return "PostgreSQL" if isinstance(exc, OperationalError | InterfaceError) else None
    return "PostgreSQL" if str(state).startswith(_POSTGRES_PASSING) else None
