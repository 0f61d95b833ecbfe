"""Payloads that travel on Redis streams between services.

Each is one stream entry with a single field (``FIELD``) holding the JSON.

``Keys.tools`` carries five kinds of job (:data:`ToolJob`: a tool call, an
Asset Directory probe, a workspace removal, a workspace checkpoint/restore, a
request about a workspace's files),
told apart by their ``kind`` and read only through :func:`parse_tool_job`
(one union, one adapter, as ``events.py`` does for events). Each kind is still
written under the entry field it had before ``kind`` existed, so a tool-runner
of the previous version still tells a new entry apart during a rolling
upgrade; the other way round, an entry that version wrote (no ``kind``) is
read by its field (``_kind_of_legacy_entry``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Self, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationInfo,
    model_validator,
)
from redis.typing import EncodableT, FieldT

if TYPE_CHECKING:
    from holdfast_shared.db.models import ToolResultRecord


class _Entry(BaseModel):
    model_config = ConfigDict(frozen=True)

    FIELD: ClassVar[str] = "job"

    def to_fields(self) -> dict[FieldT, EncodableT]:
        """The stream entry's fields, as ``XADD`` takes them."""
        return {self.FIELD: self.model_dump_json()}

    @classmethod
    def find(cls, fields: dict[str, str]) -> Self | None:
        """The payload if this entry carries one of this kind."""
        raw = fields.get(cls.FIELD)
        return None if raw is None else cls.model_validate_json(raw)

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> Self:
        """The payload; ValueError when the entry has none or it does not parse."""
        found = cls.find(fields)
        if found is None:
            raise ValueError(f"stream entry has no {cls.FIELD!r} field")
        return found


class _ToolJobEntry(_Entry):
    """A job on ``Keys.tools``: written and read through :data:`TOOL_JOB_ADAPTER`."""

    def to_fields(self) -> dict[FieldT, EncodableT]:
        """The stream entry's fields, as ``XADD`` takes them."""
        return {self.FIELD: TOOL_JOB_ADAPTER.dump_json(cast(ToolJob, self)).decode()}

    @classmethod
    def find(cls, fields: dict[str, str]) -> Self | None:
        """The job if this entry carries one of this kind."""
        if cls.FIELD not in fields:
            return None
        job = parse_tool_job(fields)
        return job if isinstance(job, cls) else None


class TurnJob(_Entry):
    """One turn to run: appended by the gateway to ``Keys.turns``.

    The user's message (and its media) is already stored as the turn's
    ``messages`` row at position 0 when the job is enqueued, so a job never
    carries the only copy of user input. ``task_id`` is the engine's id of the
    task (``Task.id``).
    """

    task_id: str
    turn_id: str
    tenant_id: str
    agent: str | None = None
    model: str | None = None
    # Set when the job continues a turn that already ran (after a crash, a
    # hand-back on shutdown, an answered question or a lost Redis): the
    # worker picks it up from its last snapshot.
    resume: bool = False
    # W3C trace context of the request that queued the turn (observability/tracing.py);
    # None when tracing is off, and in jobs queued before the field existed.
    traceparent: str | None = None

    @classmethod
    def resuming(cls, tenant_id: str, task_id: str, turn_id: str) -> TurnJob:
        """A job that continues an existing turn from its snapshot."""
        return cls(task_id=task_id, turn_id=turn_id, tenant_id=tenant_id, resume=True)


def idempotency_key(tenant_id: str, task_id: str, turn_id: str, tool_call_id: str) -> str:
    """The key a tool call carries to its tool (``HOLDFAST_IDEMPOTENCY_KEY``, MCP
    ``_meta``): the same for every delivery and every attempt of the call, and
    for no other call. A hash, so it says nothing of the ids it is made of."""
    digest = hashlib.sha256("\x1f".join((tenant_id, task_id, turn_id, tool_call_id)).encode())
    return f"hf1-{digest.hexdigest()[:40]}"


class ToolCallJob(_ToolJobEntry):
    """One tool call for the tool-runners (``Keys.tools``).

    ``reply_to`` is the inbox stream of the loop-worker waiting for it; the
    durable answer is the ``tool_results`` row, so a reply that finds no
    listener is not lost. ``attempt`` numbers the runs of a call whose outcome
    was unknown (1: the first); ``idempotency_key`` is the same for all of them.
    """

    kind: Literal["tool_call"] = "tool_call"
    tenant_id: str
    task_id: str
    turn_id: str
    tool_call_id: str
    tool: str
    input: dict[str, Any]
    reply_to: str
    network: bool = False
    timeout_seconds: float = 60.0
    # Skills (of the tenant's, or built-in) whose folders the call's sandbox
    # mounts read-only at .skills/<name>/ in the workspace.
    skills: tuple[str, ...] = ()
    # Set for a tool of an Asset Directory server (an MCP tool): the server's
    # name, and the server's own name for the tool (``tool`` is the model's,
    # ``{server}__{tool}``). The runner looks the server up for the tenant and
    # calls it; no credential ever travels on a stream.
    server: str | None = None
    server_tool: str | None = None
    # W3C trace context of the turn that asked for the call: the runner's span is its child.
    traceparent: str | None = None
    attempt: int = Field(default=1, ge=1)
    # Derived from the ids when absent (a job of the previous version).
    idempotency_key: str = ""

    @model_validator(mode="before")
    @classmethod
    def _key(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("idempotency_key"):
            ids = [data.get(name) for name in ("tenant_id", "task_id", "turn_id", "tool_call_id")]
            if all(isinstance(value, str) for value in ids):
                return {**data, "idempotency_key": idempotency_key(*cast(list[str], ids))}
        return data


class AssetProbe(_ToolJobEntry):
    """Connect to a tenant's Asset Directory server and list its tools: sent by
    the gateway on ``Keys.tools`` (a registration, a completed authorization).

    The runner answers on the Redis list ``reply_to`` with an
    :class:`AssetProbeResult`; the server's configuration and credentials are
    read from PostgreSQL, never carried here.
    """

    FIELD: ClassVar[str] = "asset_probe"

    kind: Literal["asset_probe"] = "asset_probe"
    tenant_id: str
    server: str
    reply_to: str


class AssetProbeResult(BaseModel):
    """What a probe found: the tools (as stored, ``assets.catalogue.listed_tool``)
    or why there are none."""

    model_config = ConfigDict(frozen=True)

    tools: list[dict[str, Any]] = []
    error: str | None = None
    # A stdio server that failed to start: the end of what it wrote to stderr.
    stderr: str | None = None
    needs_authorization: bool = False
    # Set by the gateway itself when no tool-runner answered the probe.
    no_runner: bool = False


class WorkspaceRemoval(_ToolJobEntry):
    """A deleted task's workspace to remove: sent on ``Keys.tools`` beside tool calls."""

    FIELD: ClassVar[str] = "remove_workspace"

    kind: Literal["remove_workspace"] = "remove_workspace"
    tenant_id: str
    task_id: str


class WorkspaceRequest(_ToolJobEntry):
    """Archive the task's workspace now (``checkpoint``), or replace it with the
    archive ``archive_id`` (``restore``; None: an empty workspace). Sent on
    ``Keys.tools`` by ``workspace_checkpoints.requests``; the runner answers on the
    Redis list ``reply_to`` with a :class:`WorkspaceReply`. ``request_id`` makes a
    redelivered request harmless: it is answered from the first one's result.
    """

    FIELD: ClassVar[str] = "workspace_request"

    kind: Literal["workspace_request"] = "workspace_request"
    request_id: str
    tenant_id: str
    task_id: str
    action: Literal["checkpoint", "restore"]
    archive_id: str | None = None
    reply_to: str


class WorkspaceReply(BaseModel):
    """A tool-runner's answer to a :class:`WorkspaceRequest`: the archive made (or
    restored; None when the task has no workspace yet), or why it failed."""

    model_config = ConfigDict(frozen=True)

    archive_id: str | None = None
    error: str | None = None


class WorkspaceFiles(_ToolJobEntry):
    """A request about the files of a task's workspace, for the gateway's
    ``/tasks/{id}/files``: ``list`` the directory ``path`` (``""``: the workspace;
    ``recursive``: all below it); ``read`` up to ``length`` bytes of the file
    ``path`` from ``offset`` (``archive_id``: from that archive of the task instead
    of the live workspace; ``expect_*``: refused once the file is no longer the one
    a download started with); ``write`` the file from the base64 bytes the gateway
    left at the key ``upload_key``; ``delete`` it (a directory with all it holds);
    ``copy`` the file or directory ``path`` of the task ``from_task_id``'s
    workspace to the same path of this one (a subagent's ``files``; symlinks
    are not copied). ``path`` is checked by both ends (``manifest.check_path``) and reached by the
    runner without following a symlink. The runner answers on the Redis list
    ``reply_to`` with a :class:`WorkspaceFilesReply`.
    """

    FIELD: ClassVar[str] = "workspace_files"

    kind: Literal["workspace_files"] = "workspace_files"
    request_id: str
    tenant_id: str
    task_id: str
    action: Literal["list", "read", "write", "delete", "copy"]
    path: str = ""
    from_task_id: str | None = None
    recursive: bool = False
    offset: int = 0
    length: int = 0
    archive_id: str | None = None
    expect_size: int | None = None
    expect_mtime_ns: int | None = None
    upload_key: str | None = None
    reply_to: str


class WorkspaceFile(BaseModel):
    """One entry of a workspace: a directory, a regular file (with its size and
    the SHA-256 of its content) or a symlink (listed, never followed)."""

    model_config = ConfigDict(frozen=True)

    path: str
    kind: Literal["file", "dir", "link"]
    size: int = 0
    sha256: str | None = None
    mtime_ns: int = 0


class WorkspaceFilesReply(BaseModel):
    """A tool-runner's answer to :class:`WorkspaceFiles`: the entries listed (``read``
    and ``write``: the file's own, and ``data``, the bytes read, base64; ``copy``:
    the files written), or why
    not (``problem`` classifies ``error``)."""

    model_config = ConfigDict(frozen=True)

    entries: list[WorkspaceFile] = []
    data: str | None = None
    error: str | None = None
    problem: (
        Literal["not_found", "not_a_file", "not_a_directory", "invalid_path", "full", "changed"]
        | None
    ) = None


class UnknownOutcome(BaseModel):
    """Why nobody knows what a tool call did: it was sent (``sent_at``, epoch ms)
    and no answer came — its runner was lost (``runner_lost_at``), its time ran
    out, or the connection to its MCP server broke after the request went."""

    model_config = ConfigDict(frozen=True)

    reason: str
    attempt: int = 1
    sent_at: int | None = None
    runner_lost_at: int | None = None


class ToolOutcome(BaseModel):
    """What a tool call produced: ``output`` for the model, ``error`` when it failed.

    ``unknown`` is set instead when whether the call had its effect cannot be
    told: never shown to the model as such (the loop runs a read-only or
    idempotent call again, and asks a person about an effectful one).
    """

    model_config = ConfigDict(frozen=True)

    output: Any = None
    error: str | None = None
    unknown: UnknownOutcome | None = None
    # Files the call wrote under the workspace's outputs/ (an ``artifact`` event each).
    artifacts: list[WorkspaceFile] = []

    @classmethod
    def from_record(cls, row: ToolResultRecord) -> ToolOutcome:
        """A finished ``tool_results`` row's outcome: its result, or, for an
        ``unknown`` row, that its attempt's outcome is unknown and since when."""
        if row.status == "unknown":
            lost = row.finished_at
            return cls(
                unknown=UnknownOutcome(
                    reason=row.error or "its outcome is unknown",
                    attempt=row.attempt,
                    sent_at=int(row.started_at.timestamp() * 1000),
                    runner_lost_at=int(lost.timestamp() * 1000) if lost is not None else None,
                )
            )
        return cls(output=(row.output or {}).get("value"), error=row.error)


_TOOL_JOB_MODELS = (ToolCallJob, AssetProbe, WorkspaceRemoval, WorkspaceRequest, WorkspaceFiles)
# The entry field each kind is written under (``FIELD``), and so the kind of an
# entry written before ``kind`` existed.
_KIND_BY_FIELD: dict[str, str] = {
    model.FIELD: model.model_fields["kind"].default for model in _TOOL_JOB_MODELS
}
_ENTRY_FIELD = "entry_field"


def _kind_of_legacy_entry(data: Any, info: ValidationInfo) -> Any:
    """The upgrade path: a job a producer of the previous version wrote has no
    ``kind``; its entry field says which it is, as it did then. A job with a
    ``kind`` is left as it is (its ``kind`` wins over its field)."""
    if isinstance(data, dict) and "kind" not in data and isinstance(info.context, dict):
        kind = _KIND_BY_FIELD.get(info.context.get(_ENTRY_FIELD, ""))
        if kind is not None:
            return {**data, "kind": kind}
    return data


ToolJob = Annotated[
    ToolCallJob | AssetProbe | WorkspaceRemoval | WorkspaceRequest | WorkspaceFiles,
    Field(discriminator="kind"),
]

TOOL_JOB_ADAPTER: TypeAdapter[ToolJob] = TypeAdapter(
    Annotated[ToolJob, BeforeValidator(_kind_of_legacy_entry)]
)


def parse_tool_job(fields: Mapping[str, str]) -> ToolJob:
    """The job a ``Keys.tools`` entry carries; ValueError when it has none or it
    does not parse."""
    for field in _KIND_BY_FIELD:
        raw = fields.get(field)
        if raw is not None:
            return TOOL_JOB_ADAPTER.validate_json(raw, context={_ENTRY_FIELD: field})
    raise ValueError(f"tool stream entry has none of the fields {sorted(_KIND_BY_FIELD)}")


class InboxMessage(_Entry):
    """A reply to a loop-worker (a tool outcome), by correlation id; or, before
    it, a running call's progress (``tool_progress``: a :class:`ToolCallProgress`
    as the payload), its server's question to the user (``tool_elicitation``:
    a :class:`ToolElicitation`) or its request for a completion (``tool_sampling``:
    a :class:`ToolSampling`)."""

    FIELD: ClassVar[str] = "msg"

    kind: Literal["tool_result", "tool_progress", "tool_elicitation", "tool_sampling"]
    correlation_id: str
    payload: dict[str, Any]


class ToolCallProgress(BaseModel):
    """A running MCP call's progress notification (``InboxMessage`` ``tool_progress``)."""

    model_config = ConfigDict(frozen=True)

    progress: float
    total: float | None = None
    message: str | None = None


class ToolElicitation(BaseModel):
    """A running MCP call's server asks the user (``elicitation/create``, form
    mode): ``InboxMessage`` ``tool_elicitation``. The turn asks through HITL and
    pushes an :class:`ElicitationAnswer` to ``reply_key`` (a Redis list the
    runner pops) within ``wait_seconds``; after that the runner answers
    ``cancel`` itself."""

    model_config = ConfigDict(frozen=True)

    message: str
    requested_schema: dict[str, Any]
    reply_key: str
    wait_seconds: float


class ElicitationAnswer(BaseModel):
    """The user's answer to a :class:`ToolElicitation`, as MCP's ``ElicitResult`` has it."""

    model_config = ConfigDict(frozen=True)

    action: Literal["accept", "decline", "cancel"]
    content: dict[str, Any] | None = None


class ToolSampling(BaseModel):
    """A running MCP call's server asks for a completion (``sampling/createMessage``,
    text only): ``InboxMessage`` ``tool_sampling``. The turn calls the agent's
    model and pushes a :class:`SamplingAnswer` to ``reply_key`` within
    ``wait_seconds``. ``messages``: ``{"role", "text"}``, oldest first."""

    model_config = ConfigDict(frozen=True)

    messages: list[dict[str, str]]
    system_prompt: str | None = None
    max_tokens: int
    temperature: float | None = None
    reply_key: str
    wait_seconds: float


class SamplingAnswer(BaseModel):
    """The turn's completion for a :class:`ToolSampling` (or why there is none)."""

    model_config = ConfigDict(frozen=True)

    text: str = ""
    model: str = ""
    stop_reason: str | None = None
    error: str | None = None


def elicitation_answered_key(prefix: str, request_id: str) -> str:
    """The Redis list the gateway pushes to when an ``elicitation`` HITL request
    is answered: the turn waiting for it (not parked, its call is live) wakes
    and reads the answer from PostgreSQL. ``prefix``: ``Keys.prefix``."""
    return f"{prefix}hitl:answered:{request_id}"


class TrajectoryReady(_Entry):
    """A turn's trajectory is in PostgreSQL (``trajectories``): appended by the
    loop-worker to ``Keys.trajectories`` for the learning service.

    Only the id travels; the record is read from PostgreSQL, so a redelivery
    or a sweep re-announcing it learns from the same data (and learning is
    idempotent by this id).
    """

    FIELD: ClassVar[str] = "trajectory"

    trajectory_id: str
    tenant_id: str
