"""PostgreSQL: models, engine factory and migrations."""

from holdfast_shared.db.engine import (
    autocommit_session_factory,
    create_engine,
    session_factory,
    to_async_url,
)
from holdfast_shared.db.migrate import upgrade_head
from holdfast_shared.db.models import (
    ApiKey,
    Base,
    ChannelStateSnapshot,
    EventRecord,
    Message,
    Task,
    Tenant,
    Turn,
)

__all__ = [
    "ApiKey",
    "Base",
    "ChannelStateSnapshot",
    "EventRecord",
    "Message",
    "Task",
    "Tenant",
    "Turn",
    "autocommit_session_factory",
    "create_engine",
    "session_factory",
    "to_async_url",
    "upgrade_head",
]
