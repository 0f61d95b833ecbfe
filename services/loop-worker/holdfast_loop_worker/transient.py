"""Which failures of the stores are passing states, not a turn's end.

A Redis that restarts refuses connections, then answers LOADING while it
reads its file; a PostgreSQL that restarts drops its connections, then
answers "the database system is starting up". A turn that meets one is left
as a crash leaves it (its job pending, its lease lapsing) and resumes from
its last snapshot once the store answers, instead of ending ``errored``.

An error the server raised about the statement itself (a constraint, a bug)
is not transient: running the step again would meet it again. A server short
of a resource (a full disk, out of memory: SQLSTATE class 53) is neither: it
may last, so the turn is not resumed over and over, but it is the store's
state, not the turn's fault, and it ends the turn with a code that says so
(:func:`store_refused`).
"""

from __future__ import annotations

from holdfast_shared.redisconn import closed_under_redis, refused_for_memory
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

# SQLSTATEs of a connection that broke or a server that is going down or
# coming up: class 08 (connection exception), admin/crash shutdown, cannot
# connect now.
_POSTGRES_PASSING = ("08", "57P01", "57P02", "57P03", "53300")
# Class 53, insufficient resources (53100 disk_full, 53200 out_of_memory, 53400
# configuration_limit_exceeded), but too_many_connections, which passes above.
_POSTGRES_SHORT_OF = "53"


def store_unreachable(exc: BaseException) -> str | None:
    """``"Redis"`` or ``"PostgreSQL"`` when ``exc`` says that store is unreachable
    for now (BusyLoadingError is a ConnectionError), else None.

    A Redis at its ``maxmemory`` counts: it refuses the writes a turn's end
    would need too, and archiving frees its memory, so the turn waits for it
    as for a restart (the embedded Redis 6.2 reports it from inside our
    scripts, as a plain ResponseError)."""
    if (
        isinstance(exc, RedisConnectionError | RedisTimeoutError)
        or closed_under_redis(exc)
        or refused_for_memory(exc)
    ):
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


def store_refused(exc: BaseException) -> str | None:
    """The SQLSTATE when ``exc`` is PostgreSQL refusing a write for want of a
    resource (a full disk, memory), else None."""
    if not isinstance(exc, DBAPIError) or store_unreachable(exc) is not None:
        return None
    state = getattr(exc.orig, "sqlstate", None)
    return str(state) if state and str(state).startswith(_POSTGRES_SHORT_OF) else None
