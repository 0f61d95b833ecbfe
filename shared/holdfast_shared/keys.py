"""Every Redis key name Holdfast uses, in one place.

Per-task keys carry the engine's task id (``Task.id``, never reused; not the
client's name for the task) as a hash tag (``{task_id}``) so that all keys
of one task live in one Redis Cluster slot and can be touched by one script.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache

from redis.crc import key_slot

TURNS_GROUP = "loop-workers"
TOOLS_GROUP = "tool-runners"
LEARNING_GROUP = "learners"


# The reap request's third word after a turn's normal end (Keys.tools_reap).
REAP_TURN_END = "turn-end"


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix (``HOLDFAST_REDIS_PREFIX``)."""

    prefix: str = "holdfast:"

    # -- global keys ---------------------------------------------------------
    @property
    def turns(self) -> str:
        """Stream of turn jobs, consumed by loop-workers through ``TURNS_GROUP``."""
        return f"{self.prefix}turns"

    @property
    def tools(self) -> str:
        """Stream of tool calls, consumed by tool-runners through ``TOOLS_GROUP``."""
        return f"{self.prefix}tools"

    @property
    def trajectories(self) -> str:
        """Stream of finished turns' trajectories (``TrajectoryReady``), consumed by the
        learning service through ``LEARNING_GROUP``."""
        return f"{self.prefix}trajectories"

    def learning_queue(self, *, cluster: bool = False) -> str:
        """arq's queue of the learning service's cron jobs (``learning_job`` names them).

        On a Redis Cluster arq's transactions must touch one slot, and they pair
        a job's keys with arq's global ``arq:abort``: the queue and the job names
        then carry a hash tag picked for that key's slot (``arq_slot_tag``)."""
        if cluster:
            return f"{{{arq_slot_tag(self.prefix)}}}learning"
        return f"{self.prefix}learning"

    def learning_job(self, name: str, *, cluster: bool = False) -> str:
        """A learning cron job's arq name (arq keys its runs ``arq:job:<name>:<time>``):
        with the queue's hash tag on a cluster; job ids are global in a Redis, hence
        the prefix."""
        if cluster:
            return f"{{{arq_slot_tag(self.prefix)}}}{name}"
        return f"{self.prefix}{name}"

    @property
    def learning_dead(self) -> str:
        """List of trajectory ids the learning service gave up on (the dead letters),
        newest first; the rows keep ``status = 'dead'`` and their last error."""
        return f"{self.prefix}learning:dead"

    @property
    def tools_reap(self) -> str:
        """Pub/sub channel: ``<tenant_id> <task_id>`` whose leftover tool processes every
        runner kills, its stdio MCP servers too; ``<tenant_id> <task_id> turn-end``
        (:data:`REAP_TURN_END`) after a turn's normal end, which spares those servers
        (kept for the task's next turns until their idle timeout)."""
        return f"{self.prefix}tools:reap"

    @property
    def archive_dirty(self) -> str:
        """Sorted set of task ids whose events are not all in PostgreSQL yet."""
        return f"{self.prefix}archive:dirty"

    @property
    def providers(self) -> str:
        """Sorted set: model providers some live loop-worker can run, scored by expiry (ms)."""
        return f"{self.prefix}providers"

    @property
    def default_models(self) -> str:
        """Sorted set: each live loop-worker's default ``provider:model``, scored by expiry (ms)."""
        return f"{self.prefix}default-models"

    @property
    def unavailable_models(self) -> str:
        """Sorted set: ``[provider:model, reason]`` (JSON) of models a live loop-worker
        cannot serve (their window is too small), scored by expiry (ms)."""
        return f"{self.prefix}unavailable-models"

    def model_calls(self, endpoint: str) -> str:
        """Sorted set: the turns' model calls under way on a provider endpoint,
        scored by when each is given up for dead (ms); the learning centre waits
        while there are any on its own (``holdfast_shared.endpoint_calls``)."""
        return f"{self.prefix}model-calls:{endpoint}"

    @property
    def runners(self) -> str:
        """Sorted set: live tool-runner ids, scored by when their liveness lapses (ms)."""
        return f"{self.prefix}runners"

    def worker_inbox(self, worker_id: str) -> str:
        """A loop-worker's inbox: tool results and HITL answers for its turns."""
        return f"{self.prefix}worker:{worker_id}:inbox"

    def worker_alive(self, worker_id: str) -> str:
        """Present while the loop-worker ``worker_id`` lives (refreshed, short TTL); the
        providers it serves, as JSON. Written only once they are advertised in
        :attr:`providers`, so a worker seen alive is one the gateway routes turns to."""
        return f"{self.prefix}worker:{worker_id}:alive"

    def runner_alive(self, runner_id: str) -> str:
        """Present while the tool-runner ``runner_id`` lives (refreshed, short TTL); its
        sandbox probe as JSON."""
        return f"{self.prefix}runner:{runner_id}:alive"

    def tenant_requests(self, tenant_id: str) -> str:
        """Sorted set: the tenant's requests of the last minute, scored by when (ms), for
        ``HOLDFAST_TENANT_RATE_PER_MINUTE`` (``holdfast_gateway.limits``); one key per
        tenant, so it hashes to one slot on its own."""
        return f"{self.prefix}tenant:{{{tenant_id}}}:requests"

    def tenant_stored_bytes(self, tenant_id: str) -> str:
        """The tenant's bytes in PostgreSQL and the archive store, as last measured
        (``holdfast_gateway.storageusage``); expires after the refresh interval."""
        return f"{self.prefix}tenant:{{{tenant_id}}}:stored-bytes"

    def tenant_workspace_bytes(self, tenant_id: str) -> str:
        """Hash: task id → bytes its live workspace takes on a tool-runner's disk, as
        the runner holding it last reported (``holdfast_tool_runner.diskusage``)."""
        return f"{self.prefix}tenant:{{{tenant_id}}}:workspace-bytes"

    def learner_alive(self, learner_id: str) -> str:
        """Present while the learning process ``learner_id`` consumes trajectories
        (refreshed, short TTL)."""
        return f"{self.prefix}learner:{learner_id}:alive"

    def asset_probe_reply(self, request_id: str) -> str:
        """List a tool-runner pushes its answer to an ``AssetProbe`` onto (the gateway
        waits on it with ``BLPOP``); short-lived."""
        return f"{self.prefix}assets:probe:{request_id}"

    def workspace_reply(self, request_id: str) -> str:
        """List a tool-runner pushes its answer to a ``WorkspaceRequest`` onto (the
        requester waits on it with ``BLPOP``); short-lived."""
        return f"{self.prefix}workspace:reply:{request_id}"

    def workspace_done(self, request_id: str) -> str:
        """The answer to a finished ``WorkspaceRequest``, kept a while so a redelivered
        request is answered again instead of being carried out twice."""
        return f"{self.prefix}workspace:done:{request_id}"

    def workspace_upload(self, request_id: str) -> str:
        """The bytes of an upload (base64) a ``WorkspaceFiles`` write request takes
        into a workspace: left by the gateway, deleted by the runner; short-lived."""
        return f"{self.prefix}workspace:upload:{request_id}"

    def gateway_wake(self, gateway_id: str) -> str:
        """Stream a gateway's tailer also blocks on, so a new subscriber can wake it."""
        return f"{self.prefix}gateway:{gateway_id}:wake"

    # -- per-task keys (hash-tagged) ----------------------------------------
    def events(self, task_id: str) -> str:
        """The task's hot event log: entry id ``<seq>-0``, fields ``t``, ``ts``, ``d``."""
        return f"{self.prefix}task:{{{task_id}}}:events"

    def archived(self, task_id: str) -> str:
        """Highest seq of the task already written to PostgreSQL."""
        return f"{self.prefix}task:{{{task_id}}}:archived"

    def cancel(self, task_id: str) -> str:
        """Id of the task's turn that was asked to stop (``POST /execute/cancel``)."""
        return f"{self.prefix}task:{{{task_id}}}:cancel"

    @property
    def cancels(self) -> str:
        """Pub/sub channel: ``<task_id> <turn_id>`` of a turn to stop now."""
        return f"{self.prefix}cancels"

    def archiving(self, task_id: str) -> str:
        """Held by the archiver copying the task's events (so others skip it)."""
        return f"{self.prefix}task:{{{task_id}}}:archiving"

    def turn_epoch(self, task_id: str) -> str:
        """Counter bumped by each worker that takes the task's turn: fences stale writers."""
        return f"{self.prefix}task:{{{task_id}}}:epoch"

    def running_turn(self, task_id: str) -> str:
        """Id of the task's running turn; its presence is the one-turn-per-task lock."""
        return f"{self.prefix}task:{{{task_id}}}:turn"

    @property
    def pauses(self) -> str:
        """Pub/sub channel: ``<task_id> <turn_id>`` of a turn asked to pause; the
        worker running it cuts a model call short instead of waiting for its end."""
        return f"{self.prefix}pauses"

    def pause(self, task_id: str) -> str:
        """Id of the task's turn asked to pause (``POST /v1/execution/{id}/pause``):
        the loop-worker parks it at its next step boundary."""
        return f"{self.prefix}task:{{{task_id}}}:pause"

    def working_memory(self, task_id: str) -> str:
        """Hash: the task's working memory (the agent's scratchpad), key → value;
        expires ``HOLDFAST_WORKING_MEMORY_TTL`` after its last change (PostgreSQL
        keeps the copy each turn ended with)."""
        return f"{self.prefix}task:{{{task_id}}}:wm"

    def task_keys(self, task_id: str) -> tuple[str, ...]:
        """Every per-task key, for deleting a task."""
        return (
            self.events(task_id),
            self.archived(task_id),
            self.cancel(task_id),
            self.archiving(task_id),
            self.turn_epoch(task_id),
            self.running_turn(task_id),
            self.working_memory(task_id),
            self.pause(task_id),
        )


# arq's one key without a job id or the queue's name in it; its transactions
# pair it with those (arq.constants.abort_jobs_ss).
ARQ_ABORT_KEY = "arq:abort"


@lru_cache
def arq_slot_tag(prefix: str) -> str:
    """The first ``<prefix>arq-<n>`` that hashes to ``arq:abort``'s cluster slot
    (about 16,000 tries on average, once per process)."""
    slot = key_slot(ARQ_ABORT_KEY.encode())
    for n in itertools.count():
        tag = f"{prefix}arq-{n}"
        if key_slot(tag.encode()) == slot:
            return tag
    raise AssertionError("unreachable")  # pragma: no cover
