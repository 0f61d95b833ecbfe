"""The gateway's long-lived resources, built in the app's lifespan."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from holdfast_shared.assets import Vault
from holdfast_shared.eventlog import EventLog
from holdfast_shared.keys import Keys
from holdfast_shared.memory.index import MemoryIndex
from holdfast_shared.settings import Settings
from holdfast_shared.turnlock import TurnLock
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from holdfast_gateway.auth import KeyAuthenticator
from holdfast_gateway.clock import Clock, SystemClock
from holdfast_gateway.fanout import Hub
from holdfast_gateway.streamtokens import StreamTokens


@dataclass
class GatewayState:
    settings: Settings
    redis: Redis
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    keys: Keys
    eventlog: EventLog
    # The log as the streams read it: ``eventlog`` itself, or on a cluster whose
    # appends wait for a replica, the same log read from the replicas (app.py).
    reads: EventLog
    hub: Hub
    lock: TurnLock
    auth: KeyAuthenticator
    # Vector search over long-term memory; None: full text alone (no pgvector,
    # or HOLDFAST_EMBEDDER=none).
    memory_index: MemoryIndex | None = None
    # Seals and opens the Asset Directory's credentials (HOLDFAST_ASSET_ENCRYPTION_KEY;
    # the lifespan refuses to start without it).
    vault: Vault | None = None
    # Signs and checks the stream tokens of GET /execute/replay?token= (routes/auth.py).
    stream_tokens: StreamTokens | None = None
    started_at: float = field(default_factory=time.monotonic)
    # The scheduler's time (HOLDFAST_SCHEDULE_CLOCK_OFFSET_SECONDS moves it, for tests),
    # and what wakes it: set when a schedule is created or resumed here.
    clock: Clock = field(default_factory=SystemClock)
    schedules_changed: asyncio.Event = field(default_factory=asyncio.Event)
