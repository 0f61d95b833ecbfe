"""``/memory``: the brain's long-term memory over HTTP.

A brain is the caller's tenant, or one end user inside it: every operation
takes ``user_id`` (in the query, or in the body of ``POST
/memory/knowledge`` and ``PUT /memory/soul``); without it, the tenant's own
brain. Brains never see each other's memories: a fact of another user or
another tenant answers 404 ``MEMORY_NOT_FOUND``, as an id that does not
exist does.

* ``GET /memory/{episodes|knowledge|social}/search?q=`` — full-text search
  fused with vector similarity where there is some (``memory/search.py``).
* ``POST /memory/knowledge`` — tell the brain a fact: created, merged into
  the same fact on record, or superseding the current fact of the same
  ``key`` (201, with ``action``). ``GET``/``DELETE /memory/knowledge/{id}``
  — a fact with the versions it superseded; forget it with them.
* ``GET``/``PUT /memory/soul``, ``GET /memory/soul/versions`` — the soul,
  every version kept.
* ``GET /memory/export``, ``POST /memory/import`` — the whole brain as
  NDJSON (``memory/transfer.py`` defines the format, ``memory/importing.py``
  what an import guarantees).
* ``DELETE /memory`` — forget a brain entirely (an end user's, or the
  tenant's own).

Writes are made in one transaction each, by the functions of
``holdfast_shared.memory.store`` (which serialise writes to one brain), so
the learning service and the loop-worker's ``memory_save`` see the same
rules. Each write ends with a call to :func:`_index` or :func:`_unindex`:
the place where vector indexing joins.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from holdfast_shared.content import NO_NUL_PATTERN, Text
from holdfast_shared.db.models import Fact, SoulVersion
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.memory.brain import USER_ID_PATTERN, Brain
from holdfast_shared.memory.search import Kind, Searcher, fact_extra
from holdfast_shared.memory.store import (
    MAX_FACT_CHARS,
    MAX_SOUL_CHARS,
    current_soul,
    delete_fact,
    fact_history,
    forget,
    get_fact,
    revise_soul,
    save_fact,
)
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway import errors
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep
from holdfast_gateway.errors import ApiError
from holdfast_gateway.memory import importing, transfer
from holdfast_gateway.state import GatewayState
from holdfast_gateway.storagequota import check_storage

router = APIRouter(tags=["memory"])

MAX_QUERY_CHARS = 1000
# What ``str.strip`` removes (``str.isspace``), as a character class.
_SPACE_CLASS = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
# At least one character that is neither NUL nor space: the JSON Schema form
# of what _not_blank checks.
NOT_BLANK_PATTERN = rf"^[^\x00]*[^\x00{_SPACE_CLASS}][^\x00]*$"


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must contain something besides spaces")
    return value


UserIdQuery = Annotated[
    str | None,
    Query(
        pattern=USER_ID_PATTERN,
        description="the end user whose memory this is (default: the tenant's own)",
    ),
]
UserIdField = Annotated[
    str | None,
    Field(
        pattern=USER_ID_PATTERN,
        description="the end user whose memory this is (default: the tenant's own)",
    ),
]
FactId = Annotated[str, Path(pattern=ID_PATTERN, max_length=64)]


def _brain(tenant: str, user_id: str | None) -> Brain:
    return Brain(tenant, user_id or "")


# -- the vector index hook -----------------------------------------------------------


async def _index(
    state: GatewayState, session: AsyncSession, brain: Brain, kind: Kind, ids: Sequence[str]
) -> None:
    """Rows of ``kind`` were written (created, merged, imported): embed them, in the
    write's own transaction (nothing to do without pgvector or an embedder)."""
    if state.memory_index is not None:
        await state.memory_index.add_ids(session, brain, kind, ids)


async def _unindex(
    state: GatewayState, session: AsyncSession, kind: Kind, ids: Sequence[str]
) -> None:
    """Rows of ``kind`` were deleted: their vectors go too (``memory_vectors`` has
    no foreign key to them)."""
    if state.memory_index is not None:
        await state.memory_index.remove(session, kind, ids)


async def _unindex_brain(state: GatewayState, session: AsyncSession, brain: Brain) -> None:
    """The whole brain was forgotten: every vector of it goes."""
    if state.memory_index is not None:
        await state.memory_index.forget(session, brain)


def _searcher(state: GatewayState) -> Searcher:
    # Full text, fused with vector similarity where pgvector and an embedder are there.
    return Searcher(state.memory_index)


# -- search --------------------------------------------------------------------------


class Hit(BaseModel):
    """One memory found; the fields after ``created_at`` depend on the kind."""

    model_config = ConfigDict(extra="allow")

    id: str
    kind: Kind
    text: str
    score: float
    created_at: str = Field(json_schema_extra={"format": "date-time"})


class SearchResults(BaseModel):
    results: list[Hit]


def _search_route(kind: Kind, what: str) -> None:
    async def search(
        state: StateDep,
        tenant: TenantDep,
        q: Annotated[
            str,
            Query(
                min_length=1,
                max_length=MAX_QUERY_CHARS,
                pattern=NO_NUL_PATTERN,
                description="what to look for, in words",
            ),
        ],
        limit: Annotated[int, Query(ge=1, le=100)] = 10,
        user_id: UserIdQuery = None,
    ) -> dict[str, Any]:
        async with state.sessions() as session:
            hits = await _searcher(state).search(
                session, _brain(tenant, user_id), q, kinds=(kind,), limit=limit
            )
        return {"results": [hit.to_json() for hit in hits]}

    router.add_api_route(
        f"/memory/{kind}/search",
        search,
        methods=["GET"],
        name=f"search_{kind}",
        response_model=SearchResults,
        responses=errors.responses(*errors.AUTHENTICATED),
        summary=f"Search the brain's {what}",
    )


# Before /memory/knowledge/{fact_id}, which "search" would match too.
_search_route("episodes", "episodes: what happened, with whom, the outcome")
_search_route("knowledge", "knowledge: current facts (superseded ones are history)")
_search_route("social", "social graph: people, organisations, projects and their relations")


# -- knowledge -----------------------------------------------------------------------


class NewFact(BaseModel):
    """``POST /memory/knowledge``'s body."""

    model_config = ConfigDict(extra="forbid")

    text: Annotated[
        Text,
        AfterValidator(_not_blank),
        Field(
            min_length=1,
            max_length=MAX_FACT_CHARS,
            description="one atomic statement",
            json_schema_extra={"pattern": NOT_BLANK_PATTERN},
        ),
    ]
    user_id: UserIdField = None
    key: (
        Annotated[
            Text,
            Field(
                min_length=1,
                max_length=200,
                description="what the fact is about (e.g. `user.home_city`): a new fact with the "
                "key of a current one supersedes it",
            ),
        ]
        | None
    ) = None
    confidence: Annotated[float, Strict(), Field(ge=0, le=1, allow_inf_nan=False)] = 0.8


class FactBody(BaseModel):
    id: str
    user_id: str
    text: str
    key: str | None
    confidence: float
    # Trajectory ids, "api", "tool:<task>", "import": who told it.
    sources: list[str]
    valid_from: str = Field(json_schema_extra={"format": "date-time"})
    valid_to: str | None = Field(json_schema_extra={"format": "date-time"})
    superseded_by: str | None
    created_at: str = Field(json_schema_extra={"format": "date-time"})
    updated_at: str = Field(json_schema_extra={"format": "date-time"})


class SavedFact(FactBody):
    action: Literal["created", "merged", "superseded"]
    # The fact this one superseded (action "superseded").
    supersedes: str | None


class FactWithHistory(FactBody):
    # The versions it superseded, newest first.
    history: list[FactBody]


def _fact(fact: Fact) -> dict[str, Any]:
    return {
        "id": fact.id,
        "user_id": fact.user_id,
        "text": fact.text,
        "created_at": fact.created_at.isoformat(),
        "updated_at": fact.updated_at.isoformat(),
        **fact_extra(fact),
    }


def _not_found(fact_id: str) -> ApiError:
    return ApiError(404, ErrorCode.MEMORY_NOT_FOUND, f"fact {fact_id!r} not found", {"id": fact_id})


# What a client can do next with the fact it told (of the tenant's own brain;
# a user's needs the same user_id).
_FACT_LINKS = {
    "GetFact": {"operationId": "get_knowledge", "parameters": {"fact_id": "$response.body#/id"}},
    "DeleteFact": {
        "operationId": "delete_knowledge",
        "parameters": {"fact_id": "$response.body#/id"},
    },
}


@router.post(
    "/memory/knowledge",
    status_code=201,
    response_model=SavedFact,
    dependencies=[JsonBody],
    responses={
        201: {"description": "The fact as recorded, and what saving it did", "links": _FACT_LINKS},
        **errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY),
    },
    summary="Tell the brain a fact: created, merged, or superseding the current one of its key",
)
async def save_knowledge(
    state: StateDep, tenant: TenantDep, body: Annotated[NewFact, Body()]
) -> dict[str, Any]:
    brain = _brain(tenant, body.user_id)
    async with state.sessions.begin() as session:
        change = await save_fact(
            session, brain, body.text, source="api", key=body.key, confidence=body.confidence
        )
        await _index(state, session, brain, "knowledge", [change.fact.id])
        saved = _fact(change.fact)
    previous = change.previous.id if change.previous is not None else None
    return {**saved, "action": change.action, "supersedes": previous}


@router.get(
    "/memory/knowledge/{fact_id}",
    response_model=FactWithHistory,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="A fact, with the versions it superseded (newest first)",
)
async def get_knowledge(
    state: StateDep, tenant: TenantDep, fact_id: FactId, user_id: UserIdQuery = None
) -> dict[str, Any]:
    async with state.sessions() as session:
        fact = await get_fact(session, _brain(tenant, user_id), fact_id)
        if fact is None:
            raise _not_found(fact_id)
        history = await fact_history(session, fact)
    return {**_fact(fact), "history": [_fact(older) for older in history]}


@router.delete(
    "/memory/knowledge/{fact_id}",
    status_code=204,
    response_class=Response,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="Forget a fact, and the versions it superseded",
)
async def delete_knowledge(
    state: StateDep, tenant: TenantDep, fact_id: FactId, user_id: UserIdQuery = None
) -> Response:
    brain = _brain(tenant, user_id)
    async with state.sessions.begin() as session:
        fact = await get_fact(session, brain, fact_id)
        if fact is None:
            raise _not_found(fact_id)
        ids = [fact.id, *(older.id for older in await fact_history(session, fact))]
        await delete_fact(session, brain, fact_id)
        await _unindex(state, session, "knowledge", ids)
    return Response(status_code=204)


# -- the soul ------------------------------------------------------------------------


class NewSoul(BaseModel):
    """``PUT /memory/soul``'s body."""

    model_config = ConfigDict(extra="forbid")

    content: Annotated[
        Text,
        Field(
            max_length=MAX_SOUL_CHARS,
            description="who the user is, what they prefer: the whole document",
        ),
    ]
    user_id: UserIdField = None


class Soul(BaseModel):
    content: str
    # 0: there is none yet.
    version: int
    updated_at: str | None = Field(json_schema_extra={"format": "date-time"})
    # How many versions there are (the current one included).
    versions: int


class SoulVersionBody(BaseModel):
    version: int
    content: str
    # learning | api | import
    source: str
    trajectory_id: str | None
    created_at: str = Field(json_schema_extra={"format": "date-time"})


class SoulVersions(BaseModel):
    versions: list[SoulVersionBody]


async def _soul(session: AsyncSession, brain: Brain) -> dict[str, Any]:
    soul = await current_soul(session, brain)
    if soul is None:
        return {"content": "", "version": 0, "updated_at": None, "versions": 0}
    count = await session.scalar(
        select(func.count())
        .select_from(SoulVersion)
        .where(SoulVersion.tenant_id == brain.tenant_id, SoulVersion.user_id == brain.user_id)
    )
    return {
        "content": soul.content,
        "version": soul.version,
        "updated_at": soul.created_at.isoformat(),
        "versions": int(count or 0),
    }


@router.get(
    "/memory/soul",
    response_model=Soul,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="The soul: who the user is and what they prefer (version 0: none yet)",
)
async def get_soul(state: StateDep, tenant: TenantDep, user_id: UserIdQuery = None) -> Any:
    async with state.sessions() as session:
        return await _soul(session, _brain(tenant, user_id))


@router.put(
    "/memory/soul",
    response_model=Soul,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY),
    summary="Revise the soul: a new version (the same content as the current one: none)",
)
async def put_soul(state: StateDep, tenant: TenantDep, body: Annotated[NewSoul, Body()]) -> Any:
    brain = _brain(tenant, body.user_id)
    async with state.sessions.begin() as session:
        await revise_soul(session, brain, body.content, source="api")
        return await _soul(session, brain)


@router.get(
    "/memory/soul/versions",
    response_model=SoulVersions,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="Every version of the soul, newest first",
)
async def soul_versions(state: StateDep, tenant: TenantDep, user_id: UserIdQuery = None) -> Any:
    brain = _brain(tenant, user_id)
    async with state.sessions() as session:
        rows = (
            await session.scalars(
                select(SoulVersion)
                .where(
                    SoulVersion.tenant_id == brain.tenant_id,
                    SoulVersion.user_id == brain.user_id,
                )
                .order_by(SoulVersion.version.desc())
            )
        ).all()
    return {
        "versions": [
            {
                "version": row.version,
                "content": row.content,
                "source": row.source,
                "trajectory_id": row.trajectory_id,
                "created_at": row.created_at.isoformat(),
            }
            for row in rows
        ]
    }


# -- export and import ---------------------------------------------------------------


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` references replaced by the definitions,
    for an ``openapi_extra`` that cannot add components."""
    definitions = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(definitions[ref.removeprefix("#/$defs/")])
            # The mapping names $defs; "kind" alone still tells the branches apart.
            return {k: resolve(v) for k, v in node.items() if k != "discriminator"}
        if isinstance(node, list):
            return [resolve(item) for item in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


_LINE_SCHEMA = _inlined(transfer.LINE_ADAPTER.json_schema())
_LINE_SCHEMA["description"] = (
    "One line of the NDJSON: a fact, episode, entity, relation or soul version, "
    "told apart by `kind`."
)


class Forgotten(BaseModel):
    user_id: str
    # Rows deleted, per table: relations, entities, knowledge, episodes,
    # soul_versions, trajectories.
    deleted: dict[str, int]


class Imported(BaseModel):
    # Non-blank lines read.
    lines: int
    # Rows per kind of line (fact, episode, entity, relation, soul).
    created: dict[str, int]
    updated: dict[str, int]
    # Already as the lines say: importing a file again leaves every row here.
    unchanged: dict[str, int]


@router.get(
    "/memory/export",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The brain as NDJSON, one line per row (each line as described)",
            "content": {transfer.MEDIA_TYPE: {"schema": _LINE_SCHEMA}},
        },
        **errors.responses(*errors.AUTHENTICATED),
    },
    summary="Everything the brain holds, as NDJSON (streamed)",
)
async def export_memory(
    state: StateDep, tenant: TenantDep, user_id: UserIdQuery = None
) -> StreamingResponse:
    """Every fact (with the history it superseded), episode, entity, relation
    and soul version of the brain, one JSON object per line, ``kind`` first,
    in a stable order: the same brain exports the same bytes, and ``POST
    /memory/import`` takes them back.

    The trajectories the brain was learned from are not part of it: they are
    raw learning input with a retention of their own
    (``HOLDFAST_TRAJECTORY_RETENTION_DAYS``), not memory.
    """
    brain = _brain(tenant, user_id)

    async def lines() -> AsyncIterator[bytes]:
        async with state.sessions() as session:
            async for chunk in transfer.export(session, brain):
                yield chunk

    return StreamingResponse(lines(), media_type=transfer.MEDIA_TYPE)


def _require_ndjson(request: Request) -> None:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type not in (transfer.MEDIA_TYPE, "application/jsonl"):
        raise ApiError(
            415,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"the body must be sent as {transfer.MEDIA_TYPE}, not "
            + (repr(media_type[:100]) if media_type else "without a content type"),
        )


def _refused(exc: transfer.ImportRefused) -> ApiError:
    problems = [error.to_json() for error in exc.errors]
    summary = "; ".join(f"line {e.line}: {'.'.join(e.loc) or 'line'}: {e.msg}" for e in exc.errors)
    if exc.total > len(exc.errors):
        summary += f"; and {exc.total - len(exc.errors)} more"
    return ApiError(
        422,
        ErrorCode.INVALID_REQUEST,
        f"invalid request, nothing imported: {summary}",
        {"errors": problems, "total": exc.total},
    )


@router.post(
    "/memory/import",
    response_model=Imported,
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 507),
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "NDJSON as `GET /memory/export` writes it: each item is one line",
            "content": {transfer.MEDIA_TYPE: {"schema": {"type": "array", "items": _LINE_SCHEMA}}},
        }
    },
    summary="Import NDJSON of a brain (an export): upserted by id, all or nothing",
)
async def import_memory(
    request: Request, state: StateDep, tenant: TenantDep, user_id: UserIdQuery = None
) -> dict[str, Any]:
    """Write the lines into the brain named by ``user_id`` (whichever brain
    they came from), in one transaction: rows are upserted by id, so
    importing the same lines twice changes nothing, and an export imported
    into the brain it came from, after ``DELETE /memory``, exports the same
    bytes again. Lines of another brain get ids of this one, so a copy never
    touches the original.

    Every line is checked before anything is written: 422
    ``INVALID_REQUEST`` with ``details.errors`` naming each bad line
    (``line``, from 1) and its field (``loc``), and nothing is imported.
    The body is capped at ``HOLDFAST_MAX_BODY_BYTES`` (413); split bigger
    exports (at line boundaries, entities before the relations joining them).
    """
    _require_ndjson(request)
    await check_storage(state, tenant)
    brain = _brain(tenant, user_id)
    body = await request.body()
    try:
        # Up to HOLDFAST_MAX_BODY_BYTES of JSON to validate: half a second of
        # CPU at 8 MiB, off the event loop.
        lines = await asyncio.to_thread(transfer.parse, body)
        async with state.sessions.begin() as session:
            result = await importing.import_lines(session, brain, lines)
            await _index(state, session, brain, "knowledge", result.written["fact"])
            await _index(state, session, brain, "episodes", result.written["episode"])
            await _index(state, session, brain, "social", result.written["entity"])
    except transfer.ImportRefused as exc:
        raise _refused(exc) from None
    except IntegrityError as exc:
        # What the checks before writing cannot foresee (rows swapping
        # names within one file): the transaction is rolled back, nothing
        # is imported, and the constraint says what collided.
        constraint = getattr(exc.orig, "constraint_name", None) or "a unique index"
        problem = {
            "loc": ["body"],
            "msg": f"the lines collide with each other or the brain ({constraint})",
            "type": "conflict",
        }
        raise ApiError(
            422,
            ErrorCode.INVALID_REQUEST,
            f"invalid request, nothing imported: {problem['msg']}",
            {"errors": [problem], "total": 1},
        ) from None
    return result.to_json()


@router.delete(
    "/memory",
    response_model=Forgotten,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="Forget a brain entirely: an end user's (user_id), or the tenant's own",
)
async def forget_memory(state: StateDep, tenant: TenantDep, user_id: UserIdQuery = None) -> Any:
    """Deletes every fact, episode, entity, relation and soul version of the
    brain, and the trajectories it was learned from."""
    brain = _brain(tenant, user_id)
    async with state.sessions.begin() as session:
        deleted = await forget(session, brain)
        await _unindex_brain(state, session, brain)
    return {"user_id": brain.user_id, "deleted": deleted}
