"""Settings shared by every Holdfast service, read from ``HOLDFAST_*`` variables."""

from __future__ import annotations

import ipaddress
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """One settings object for all services; each reads what it needs.

    ``redis_url`` / ``database_url`` left unset means "embedded": only
    ``holdfast up`` accepts that, and fills them in before it starts services.
    """

    model_config = SettingsConfigDict(env_prefix="HOLDFAST_", extra="ignore")

    redis_url: str | None = None
    database_url: str | None = None
    # PostgreSQL connections each process keeps open between uses (unset: each
    # service's own figure, 4 to 8). Bursts may still open as many as before; those
    # above this are closed when returned. Many processes on one server with a
    # low max_connections (the test suite's engines) set it low.
    database_pool_size: int | None = Field(default=None, ge=1, le=100)
    # Every Redis key starts with this, so test runs (and several engines on
    # one Redis) never see each other's keys.
    redis_prefix: str = "holdfast:"
    # HOLDFAST_REDIS_URL names any node of a Redis Cluster (holdfast_shared.redisconn;
    # docs/reliability.md, "Redis Cluster").
    redis_cluster: bool = False
    # After each append the client is told about, WAIT for this many replicas to
    # have it (0: no WAIT), up to redis_wait_timeout_ms. On a cluster, ≥ 1 also
    # makes the gateways read the streams from replicas (gateway app.py).
    redis_wait_replicas: int = Field(default=0, ge=0, le=16)
    redis_wait_timeout_ms: int = Field(default=1000, ge=1, le=60_000)
    # Every Redis reply is waited for at most this long, and a connection made
    # in at most the second (every client: holdfast_shared.redisconn): a Redis
    # that goes silent is noticed, not waited for. Blocking commands wait in
    # slices under it (redisconn.BLOCK_SLICE_SECONDS, 5 s); the socket timeout
    # is raised to 1 s above the longest wait if need be (a long WAIT).
    redis_socket_timeout_seconds: float = Field(default=15.0, ge=6.0, le=600.0)
    redis_connect_timeout_seconds: float = Field(default=5.0, gt=0, le=600.0)
    data_dir: Path = Field(default_factory=lambda: Path.home() / ".holdfast")

    # The event loop of the services (holdfast_shared.runtime): uvloop where it is
    # installed ("auto"), or the standard library's ("asyncio").
    event_loop: Literal["auto", "asyncio"] = "auto"

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # The gateway answers 413 to a request body larger than this, before
    # reading it whole (Content-Length is checked first, then bytes as they come).
    max_body_bytes: int = Field(default=8 * 1024**2, ge=64 * 1024)
    # The gateway answers 503 UNAVAILABLE (Retry-After) to a request that has
    # not started its response after this long: a stalled or partitioned store
    # answers nothing, and nothing may wait forever (deadline.py). An SSE stream
    # counts until its headers, not for its length.
    request_timeout_seconds: float = Field(default=30.0, gt=0)
    # Failed API-key checks one client address may make per window; past
    # that its bad keys get 429 with Retry-After instead of 401 (a valid key
    # is still answered: only failures count).
    auth_failures_allowed: int = Field(default=30, ge=1)
    auth_failure_window_seconds: float = Field(default=60.0, gt=0)
    # Proxies whose X-Forwarded-For/-Proto the gateway believes, comma-separated
    # addresses or CIDRs ("*": any); the key-failure limit then counts the client
    # they name. Empty (the default): none, a client is its connection's address.
    trusted_proxies: str = ""
    # A gateway trusts a key it checked for this long: a revoked key (`holdfast
    # keys revoke`) stops working within it, and so do its stream tokens.
    auth_cache_ttl_seconds: float = Field(default=30.0, gt=0, le=3600)
    # Stream tokens (POST /auth/stream-token → GET /execute/replay?token=): how
    # long one lasts, and the secret its sealing key (AES-256-GCM) is derived from. Unset, it is
    # derived from the first HOLDFAST_ASSET_ENCRYPTION_KEY, which every gateway
    # of a deployment already shares (holdfast_gateway.streamtokens).
    stream_token_ttl_seconds: int = Field(default=300, ge=10, le=86_400)
    stream_token_secret: SecretStr | None = Field(default=None, min_length=32)
    # Interactive API docs at /docs, its assets served from the gateway's own
    # package (no CDN); off: /docs is a 404 and only /openapi.json remains.
    docs_enabled: bool = True

    heartbeat_seconds: float = 15.0
    channel_state_ttl_active: int = 10800
    channel_state_ttl_hitl: int = 259200

    model: str | None = None
    # Per-agent models: {"<agent>": "provider:model"}, over the agent's own
    # preferred model (holdfast_shared.agents); a request's "model" still wins.
    agent_models: dict[str, str] = {}
    max_iterations: int = 25
    # Messages a task keeps waiting for its running turn (on_busy enqueue,
    # interrupt, steer on /execute); one more is refused with TURN_QUEUE_FULL.
    max_queued_turns: int = Field(default=8, ge=1, le=1000)
    turn_deadline_seconds: int = 3600
    lease_seconds: int = 10
    # On SIGTERM a loop-worker lets running turns finish this long, then hands
    # the rest to other workers.
    drain_seconds: float = 30.0
    # Each loop-worker and tool-runner refreshes a liveness key of this TTL four times
    # per TTL; once a killed one's key lapses, the others take its turns and tool calls
    # over (holdfast_shared.liveness) instead of waiting for its lease to run out.
    liveness_seconds: float = Field(default=2.0, ge=0.5, le=60)
    # Per-tenant limits (holdfast_gateway.limits), each off at 0: authenticated requests
    # in any minute; turns running or queued for a worker; messages waiting behind their
    # task's running turn (on_busy). Over one: 429 RATE_LIMITED, nothing written.
    tenant_rate_per_minute: int = Field(default=0, ge=0)
    tenant_max_running_turns: int = Field(default=0, ge=0)
    tenant_max_queued_turns: int = Field(default=0, ge=0)
    # Bytes a tenant may keep stored (event log rows, workspace archives and blobs, live
    # workspaces on the tool-runners' disks); 0: no cap. Over it, new writes (a turn,
    # an execution, a memory import, a skill) get 507 STORAGE_QUOTA_EXCEEDED
    # (holdfast_gateway.storageusage); the stored part of the figure is at most
    # storage_usage_refresh_seconds old.
    tenant_max_storage_bytes: int = Field(default=0, ge=0)
    storage_usage_refresh_seconds: float = Field(default=30.0, gt=0, le=3600)
    # A slow SSE reader: past this many events (or bytes of them) waiting in the
    # gateway for its connection, the connection is closed; the client resumes from
    # its cursor (Last-Event-ID) and others are unaffected (holdfast_gateway.slowreader).
    sse_max_buffered_events: int = Field(default=10_000, ge=1)
    sse_max_buffered_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)

    # The operator's tool permissions: {"<agent or *>": {"<tool>": "allow"|"ask"|"deny"}},
    # over the agent's own (holdfast_shared.agents), the agent's entry over "*".
    tool_permissions: dict[str, dict[str, Literal["allow", "ask", "deny"]]] = {}
    # Agents whose tools may use the network, besides those whose definition
    # says so (everyone else's sandbox has none).
    network_agents: list[str] = []
    tool_timeout_seconds: float = 60.0
    # How many times the loop runs a read-only or idempotent tool call again (same
    # idempotency key) when its outcome is unknown: its runner died mid-call, its
    # time ran out. An effectful call is never run again unasked (outcome_unknown).
    tool_retries: int = Field(default=2, ge=0, le=10)
    # How many tool calls one tool-runner process runs at once.
    tool_concurrency: int = 8
    # Subagents (the delegate tool): how many child tasks one model response's
    # delegate calls run at once, and how deep delegation may go (1: a task's
    # children may not delegate again).
    max_subagents_per_turn: int = Field(default=4, ge=1, le=64)
    max_subagent_depth: int = Field(default=2, ge=1, le=8)
    # Sandboxed processes each tool-runner keeps spawned ahead of the calls that will
    # use them (already in their own cgroups): a call that finds one skips 10-15 ms.
    sandbox_spares: int = Field(default=4, ge=0)
    # A tool call pending this long on a runner is taken over by another one
    # (which then reports it, never runs it twice).
    tool_claim_idle_seconds: float = 30.0
    # Where tool-runners keep per-task workspaces (default: <data_dir>/workspaces).
    workspace_root: Path | None = None
    # Each workspace is its own filesystem of this size (writes past it fail with
    # ENOSPC), mounted nosuid,nodev. How: "auto" (the best that works here),
    # "loop-ext4" (an image per workspace), "tmpfs" (in memory) or "none" (a plain
    # directory: no cap). GET /health says which is in force.
    workspace_max_bytes: int = Field(default=1024**3, ge=4 * 1024**2)
    workspace_fs: Literal["auto", "loop-ext4", "tmpfs", "none"] = "auto"
    # Where workspaces are archived (shared workspace_checkpoints/): "postgres" (the
    # database) or "file:///path" (a directory every tool-runner reaches).
    workspace_store: str = Field(default="postgres", pattern=r"^(postgres|file:///.+)$")
    # A task whose workspace saw no tool call for this long is archived and its
    # local copy released (hibernated); the next call restores it. 0: never.
    workspace_hibernate_after_seconds: float = Field(default=600.0, ge=0)
    # Archive the workspace (incrementally) when each turn ends, so a lost disk
    # loses at most the files of the turn in flight.
    workspace_archive_on_turn_end: bool = True

    # Every model call's time (holdfast_shared.providers.calls), whatever the
    # provider: until its first event, between two events, and in all. The first
    # two end the attempt retryably (a hung connection, a server that stalled),
    # the last for good (a stream that never stops).
    model_first_event_timeout_seconds: float = Field(default=120.0, gt=0)
    model_idle_timeout_seconds: float = Field(default=120.0, gt=0)
    model_call_timeout_seconds: float = Field(default=900.0, gt=0)

    # The context engine (loop-worker context/). The model's context window in
    # tokens; unset: the known window of the turn's model (context/tokens.py; an
    # unknown one's is 32,768 until the server refuses a prompt: context/budget.py).
    context_window: int | None = Field(default=None, ge=1024)
    # Before a model call whose context would pass this fraction of the window,
    # the oldest turns are collapsed into a summary.
    compaction_threshold: float = Field(default=0.75, gt=0, lt=1)
    # The model that writes summaries (provider:model); unset: the turn's model.
    compaction_model: str | None = None
    # The longest answer a model call asks for (max_tokens), always cut to what
    # the window leaves after the prompt: per agent {"<agent>": n}, else per model
    # {"provider:model" or "model": n}, else this.
    max_output_tokens: int = Field(default=4096, ge=256)
    model_max_output_tokens: dict[str, Annotated[int, Field(ge=256)]] = {}
    agent_max_output_tokens: dict[str, Annotated[int, Field(ge=256)]] = {}
    # Models (fnmatch patterns, comma-separated) whose system prompt the openai
    # provider sends inside the first user message: chat templates that drop
    # system messages (llama-cpp-python's gemma). Read by the provider itself.
    openai_system_as_user: str = "*gemma*"
    # A tool result longer than this enters the model's context as its head and
    # tail with a note of what was cut (the event log keeps it whole).
    tool_result_context_chars: int = Field(default=20_000, ge=1000)
    # How long a task's working memory stays in Redis after its last change; it
    # is also kept with the task in PostgreSQL when each turn ends.
    working_memory_ttl: int = Field(default=7 * 86400, ge=60)

    # Long-term memory (shared memory/, the learning service). The retrieved-memory
    # section of each turn's context holds at most this many tokens.
    memory_context_tokens: int = Field(default=1200, ge=0)
    # The model that extracts episodes, facts, the social graph and the soul from
    # trajectories (provider:model); unset: the default model.
    learning_model: str | None = None
    # The learning centre takes trajectories in batches of up to this many, or
    # whatever arrived within the window.
    learning_batch_size: int = Field(default=32, ge=1)
    learning_batch_window_seconds: float = Field(default=0.5, gt=0)
    # Announcements a stopped learner read but never finished are taken over
    # by another after this long.
    learning_claim_idle_seconds: float = Field(default=30.0, gt=0)
    # A trajectory whose learning failed this many times goes to the dead letters.
    learning_max_attempts: int = Field(default=5, ge=1)
    # Model calls one learning process makes at once; each waits (up to
    # learning_yield_seconds) while turns are calling the same provider endpoint,
    # so a local model serves the turns first. Minutes: one turn's call on a small
    # CPU model takes a minute or more, and an extraction sent meanwhile aborts it
    # on llama-cpp-python's server (a trial with 60 s lost 3 turns of 10).
    learning_concurrency: int = Field(default=1, ge=1)
    learning_yield_seconds: float = Field(default=600.0, ge=0)
    # Raw trajectories are kept this long in PostgreSQL, then archived as
    # compressed NDJSON (one file per day) under trajectory_archive_dir, and the
    # archive files are deleted after trajectory_archive_days.
    trajectory_retention_days: int = Field(default=30, ge=1)
    trajectory_archive_days: int = Field(default=365, ge=1)
    trajectory_archive_dir: Path | None = None

    # What turns memories into vectors for similarity search next to full
    # text (memory/embedders.py): "wordllama" (local, weights in its wheel),
    # "hashing[@dims]" (local, pure Python), "openai:<model>[@dims]",
    # "gemini:<model>[@dims]" (their SDKs' keys and base URLs from the
    # environment) or "none" (full text only).
    embedder: str = Field(
        default="wordllama",
        pattern=r"^(none|wordllama|hashing(@[0-9]+)?|(openai|gemini):[^@\s]+(@[0-9]+)?)$",
    )

    # The Asset Directory (shared assets/): the Fernet key(s) that encrypt MCP
    # servers' credentials and env at rest, comma-separated, the first encrypting
    # (the others still decrypt: rotation). The gateway refuses to start without
    # one; `holdfast up` generates one and keeps it in <data_dir>/asset-key.
    asset_encryption_key: SecretStr | None = None
    # Host directories bound read-only, at the same path, into the sandbox of
    # every stdio MCP server (where the operator installed them: node_modules, a
    # virtualenv); /usr is always there.
    asset_stdio_paths: list[Path] = []
    # A tool-runner closes an MCP session idle this long (sessions are kept per
    # tenant, task and server across the task's turns; a stdio server's, which
    # runs in the task's sandbox, is closed when the turn ends).
    asset_session_idle_seconds: float = Field(default=300.0, gt=0)
    # A stdio server's session (its process, in the task's sandbox) outlives the
    # turn's end this long without a call, so the task's next turns reuse it; a
    # pause, a park (a question to the user) or the task's deletion ends it sooner.
    asset_stdio_idle_seconds: float = Field(default=300.0, gt=0)
    # A tenant's skill (POST /skills): its files together, SKILL.md included, at
    # most this many bytes once decompressed (a zip upload is also bounded by
    # HOLDFAST_MAX_BODY_BYTES as sent).
    skill_max_bytes: int = Field(default=4 * 1024**2, ge=64 * 1024)
    # Connecting to a server and listing its tools (registration, OAuth callback).
    asset_connect_timeout_seconds: float = Field(default=30.0, gt=0)
    # The gateway's public base URL, for the OAuth redirect URI
    # (<public_url>/assets/oauth/callback); unset: the URL the request came in on.
    public_url: str | None = None
    # Where the engine may connect for a tenant (MCP servers, their OAuth
    # endpoints) beyond public addresses: comma-separated host names and CIDRs,
    # e.g. "127.0.0.1/32,localhost" for a local MCP server (holdfast_shared.outbound).
    outbound_allow: str = ""

    # Completion webhooks (gateway webhooks/): a delivery is tried this many
    # times, waiting base·2^(attempt-1) seconds (at most cap, with full jitter)
    # between attempts, each bounded by the timeout; then it is dead-lettered
    # (GET /webhooks/deliveries?status=failed). Gateways look for due
    # deliveries every poll interval.
    webhook_max_attempts: int = Field(default=8, ge=1, le=100)
    webhook_backoff_base_seconds: float = Field(default=1.0, gt=0)
    webhook_backoff_cap_seconds: float = Field(default=3600.0, gt=0)
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    webhook_poll_seconds: float = Field(default=0.5, gt=0)
    # Delivered and failed deliveries are deleted this long after they were made.
    webhook_retention_days: float = Field(default=30.0, gt=0)

    # Schedules (gateway schedules/): every gateway's scheduler sleeps until the
    # next due time, at most this long (a schedule created on another gateway is
    # seen within it); after every gateway was down, catch_up "all" fires at most
    # the latest catch_up_max missed due times of a schedule.
    schedule_poll_seconds: float = Field(default=1.0, gt=0, le=60)
    schedule_catch_up_max: int = Field(default=10, ge=1, le=1000)
    # FOR TESTS ONLY: the scheduler's clock runs this many seconds ahead of the
    # system's (negative: behind), so a test can put due times and DST changes
    # seconds away. The rest of the engine keeps the real time.
    schedule_clock_offset_seconds: float = 0.0

    # How many turns one loop-worker process runs at once.
    worker_concurrency: int = 64
    # The archiver copies events from Redis to PostgreSQL at this pace.
    archive_interval_seconds: float = 0.2
    log_level: str = "INFO"
    # "json": one JSON object per line, with task_id/turn_id inside a turn (logs.py).
    log_format: Literal["text", "json"] = "text"
    # Where a loop-worker, tool-runner or learning process serves Prometheus
    # /metrics (on HOLDFAST_HOST); 0 or unset: it serves none. The gateway serves
    # /metrics on its own port. `holdfast up` gives each child its own port from
    # this base (unset: HOLDFAST_PORT + 1; 0: none). See docs/operations.md.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)

    @field_validator("redis_prefix")
    @classmethod
    def _prefix_has_no_braces(cls, value: str) -> str:
        # Braces would change the Redis Cluster hash tag of every key.
        if "{" in value or "}" in value:
            raise ValueError("redis_prefix must not contain '{' or '}'")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies_are_addresses(cls, value: str) -> str:
        # Refused at start-up rather than trusting less (or more) than meant.
        for item in (part.strip() for part in value.split(",")):
            if item and item != "*":
                try:
                    ipaddress.ip_network(item, strict=False)
                except ValueError:
                    raise ValueError(
                        f"trusted_proxies: {item!r} is not an IP address or CIDR"
                    ) from None
        return value

    @property
    def trusted_proxy_list(self) -> list[str]:
        """``HOLDFAST_TRUSTED_PROXIES`` as uvicorn's ``forwarded_allow_ips``."""
        return [part.strip() for part in self.trusted_proxies.split(",") if part.strip()]

    def permission_override(
        self, agent: str | None, tool: str
    ) -> Literal["allow", "ask", "deny"] | None:
        """The operator's rule for ``tool`` under ``agent`` (``HOLDFAST_TOOL_PERMISSIONS``:
        the agent's entry, then ``*``'s); None leaves it to the agent's definition."""
        for scope in (agent or "*", "*"):
            rule = self.tool_permissions.get(scope, {}).get(tool)
            if rule is not None:
                return rule
        return None

    def permission(self, agent: str | None, tool: str) -> Literal["allow", "ask", "deny"]:
        """The operator's rule for ``tool`` under ``agent``, else the default policy."""
        from holdfast_shared.tools import DEFAULT_PERMISSIONS

        return self.permission_override(agent, tool) or DEFAULT_PERMISSIONS.get(tool, "ask")

    @property
    def trajectory_archive(self) -> Path:
        return self.trajectory_archive_dir or self.data_dir / "trajectory-archive"

    @property
    def workspaces(self) -> Path:
        return self.workspace_root or self.data_dir / "workspaces"

    def require_urls(self) -> tuple[str, str]:
        """The Redis and database URLs, or a clear error naming what is missing."""
        missing = [
            name
            for name, value in (
                ("HOLDFAST_REDIS_URL", self.redis_url),
                ("HOLDFAST_DATABASE_URL", self.database_url),
            )
            if not value
        ]
        if missing:
            raise RuntimeError(
                f"{' and '.join(missing)} must be set to run a service on its own; "
                "`holdfast up` starts embedded servers when they are unset"
            )
        assert self.redis_url is not None and self.database_url is not None
        return self.redis_url, self.database_url


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
