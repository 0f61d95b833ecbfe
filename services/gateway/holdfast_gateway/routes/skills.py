"""``/skills``: the built-in skills and the tenant's own (Agent Skills format).

``GET /skills`` lists both (each marked ``builtin``, with its file list and
size; without the instructions, which ``GET /skills/{name}`` gives).
``POST /skills`` adds one (201), sent either as a zip of the skill's folder
(``application/zip``: ``SKILL.md`` at the archive's root, or in its one
top-level folder) or as JSON ``{"name", "description", "body", "files"?}``
(``files``: text files by relative path). ``DELETE /skills/{name}`` removes
one (204). A skill never takes a built-in's name, nor one the tenant has
(409 ``SKILL_EXISTS``; delete it first to replace it), and built-ins cannot
be deleted (409 ``SKILL_BUILTIN``). Another tenant's skills answer 404
``SKILL_NOT_FOUND``, as names that do not exist do.

Uploads are checked before anything is stored (``holdfast_shared.skills``):
a path that is absolute, climbs out with ``..``, or an archive entry that is
a link, a device, encrypted or not deflate is 422 ``INVALID_REQUEST``
naming the entry (``details.errors[].loc``); more than
``MAX_FILES`` files, a file over ``MAX_FILE_BYTES`` or all over
``HOLDFAST_SKILL_MAX_BYTES`` — counted while decompressing — is 413
``SKILL_TOO_LARGE``; a body over ``HOLDFAST_MAX_BODY_BYTES`` is 413
``BODY_TOO_LARGE`` before it is read whole. An agent's ``skills`` name
skills of this list (``/agents``); a skill deleted while an agent names it
is left out of that agent's turns. A description longer than the format's
1024 characters is accepted cut to them (what the model sees), and the 201
says so in ``warnings``.
"""

from __future__ import annotations

import asyncio
import email.message
import functools
import logging
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from holdfast_shared import skills
from holdfast_shared.content import Text
from holdfast_shared.errors import ErrorCode
from holdfast_shared.skills import (
    MAX_DESCRIPTION_CHARS,
    MAX_FILE_BYTES,
    MAX_FILES,
    NAME_PATTERN,
    SkillInvalid,
    SkillSummary,
    SkillTooLarge,
)
from holdfast_shared.skills.format import MAX_NAME_CHARS, MAX_PATH_CHARS, PATH_PATTERN
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from holdfast_gateway import errors, skillupload
from holdfast_gateway.deps import StateDep, TenantDep
from holdfast_gateway.errors import ApiError
from holdfast_gateway.storagequota import check_storage

router = APIRouter(tags=["skills"])
log = logging.getLogger(__name__)

ZIP_TYPES = ("application/zip", "application/x-zip-compressed")
# A description sent as JSON is cut to MAX_DESCRIPTION_CHARS; past this it is refused.
_MAX_SENT_DESCRIPTION_CHARS = 16 * 1024


def _encodable(value: str) -> str:
    # JSON may escape half a surrogate pair, which no file name can hold.
    value.encode()
    return value


FilePath = Annotated[
    str,
    AfterValidator(_encodable),
    Field(pattern=PATH_PATTERN, max_length=MAX_PATH_CHARS),
]


class NewSkill(BaseModel):
    """``POST /skills``'s JSON body: a skill's SKILL.md parts and its text files."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[
        str,
        Field(
            pattern=NAME_PATTERN,
            max_length=MAX_NAME_CHARS,
            description="lowercase letters, digits and single hyphens; unique among the "
            "tenant's skills and the built-ins",
        ),
    ]
    description: Annotated[
        Text,
        Field(
            min_length=1,
            max_length=_MAX_SENT_DESCRIPTION_CHARS,
            description="what the skill does and when to use it: the model sees it in "
            f"its system prompt, cut to {MAX_DESCRIPTION_CHARS} characters (with a warning)",
        ),
    ]
    body: Annotated[
        Text,
        Field(
            min_length=1,
            max_length=MAX_FILE_BYTES,
            description="the instructions (SKILL.md's Markdown body), loaded by the skill tool",
        ),
    ]
    files: Annotated[
        dict[FilePath, Text],
        Field(
            max_length=MAX_FILES - 1,
            description="text files by path relative to the skill's folder "
            "(e.g. scripts/run.py), mounted read-only at .skills/<name>/ in the workspace",
            json_schema_extra={
                # The key's own pattern, and not SKILL.md (made from the other fields).
                "propertyNames": {
                    "pattern": PATH_PATTERN,
                    "maxLength": MAX_PATH_CHARS,
                    "not": {"const": skills.SKILL_FILE},
                }
            },
        ),
    ] = {}


class SkillSummaryOut(BaseModel):
    name: str
    description: str
    builtin: bool
    # Paths of the skill's files besides SKILL.md.
    files: list[str]
    # All files together, SKILL.md included.
    size_bytes: int
    # Epoch ms; None for a built-in.
    created_at: int | None
    updated_at: int | None


class SkillOut(SkillSummaryOut):
    body: str
    # On the 201 of POST: what was changed to make the skill fit (a description
    # cut to what the model sees).
    warnings: list[str] = []


class SkillList(BaseModel):
    skills: list[SkillSummaryOut]


def _ms(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp() * 1000)


def _describe(summary: SkillSummary) -> dict[str, Any]:
    return {
        "name": summary.name,
        "description": summary.description,
        "builtin": summary.builtin,
        "files": list(summary.files),
        "size_bytes": summary.size_bytes,
        "created_at": _ms(summary.created_at),
        "updated_at": _ms(summary.updated_at),
    }


def not_found(name: str) -> ApiError:
    return ApiError(404, ErrorCode.SKILL_NOT_FOUND, f"skill {name!r} not found", {"skill": name})


def _invalid(exc: SkillInvalid, where: tuple[str, ...]) -> ApiError:
    problem = {"loc": ["body", *where, exc.entry], "msg": exc.reason, "type": exc.kind}
    return ApiError(
        422,
        ErrorCode.INVALID_REQUEST,
        f"invalid skill: {exc.entry}: {exc.reason}",
        {"errors": [problem], "entry": exc.entry},
    )


def _too_large(exc: SkillTooLarge) -> ApiError:
    return ApiError(413, ErrorCode.SKILL_TOO_LARGE, exc.message, exc.details)


def _media_type(request: Request) -> str | None:
    value = request.headers.get("content-type")
    if not value:
        return None
    parsed = email.message.Message()
    parsed["content-type"] = value
    return parsed.get_content_type()


async def _from_zip(request: Request, max_bytes: int) -> skills.Skill:
    data = await request.body()
    try:
        # Decompressing up to a few MiB: off the event loop.
        return await asyncio.to_thread(
            functools.partial(skillupload.read_archive, data, max_total_bytes=max_bytes)
        )
    except SkillInvalid as exc:
        raise _invalid(exc, ()) from None
    except SkillTooLarge as exc:
        raise _too_large(exc) from None


async def _from_json(request: Request, max_bytes: int) -> skills.Skill:
    data = await request.body()
    try:
        body = NewSkill.model_validate_json(data)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
        ) from None
    files = {path: text.encode() for path, text in body.files.items()}
    try:
        return skills.new_skill(
            body.name, body.description, body.body, files, max_total_bytes=max_bytes
        )
    except SkillInvalid as exc:
        field = () if exc.entry in ("name", "description", "body") else ("files",)
        raise _invalid(exc, field) from None
    except SkillTooLarge as exc:
        raise _too_large(exc) from None


_NAME = Annotated[str, Path(pattern=NAME_PATTERN, max_length=MAX_NAME_CHARS)]


@router.get(
    "/skills",
    response_model=SkillList,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="The skills an agent can have: the built-ins and the tenant's own",
)
async def list_skills(state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    async with state.sessions() as session:
        own = await skills.tenant_skills(session, tenant)
    described = [_describe(SkillSummary.of(s)) for s in skills.builtin_skills().values()]
    described += [_describe(summary) for summary in own]
    return {"skills": described}


@router.post(
    "/skills",
    status_code=201,
    response_model=SkillOut,
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 409, 507),
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "The skill: a zip of its folder (SKILL.md with YAML front "
            "matter name and description, and its other files), or its parts as JSON",
            "content": {
                "application/json": {"schema": NewSkill.model_json_schema()},
                "application/zip": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
    summary="Add a skill (a zip of its folder, or JSON)",
)
async def create_skill(request: Request, state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    media_type = _media_type(request)
    max_bytes = state.settings.skill_max_bytes
    if media_type in ZIP_TYPES:
        skill = await _from_zip(request, max_bytes)
    elif media_type == "application/json" or (media_type or "").endswith("+json"):
        skill = await _from_json(request, max_bytes)
    else:
        raise ApiError(
            415,
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            "the body must be sent as application/zip or application/json, not "
            + (repr(media_type[:100]) if media_type else "without a content type"),
        )
    if skill.name in skills.builtin_skills():
        raise ApiError(
            409,
            ErrorCode.SKILL_EXISTS,
            f"{skill.name!r} is the name of a built-in skill; choose another",
            {"skill": skill.name},
        )
    await check_storage(state, tenant)
    async with state.sessions.begin() as session:
        created = await skills.create_skill(session, tenant, skill)
    if created is None:
        raise ApiError(
            409,
            ErrorCode.SKILL_EXISTS,
            f"skill {skill.name!r} exists; DELETE /skills/{skill.name} first to replace it",
            {"skill": skill.name},
        )
    for warning in skill.warnings:
        log.warning("skill %s of tenant %s: %s", skill.name, tenant, warning)
    return {**_describe(created), "body": skill.body, "warnings": list(skill.warnings)}


@router.get(
    "/skills/{name}",
    response_model=SkillOut,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="One skill, with its instructions and file list",
)
async def get_skill(state: StateDep, tenant: TenantDep, name: _NAME) -> dict[str, Any]:
    builtin = skills.builtin_skills().get(name)
    if builtin is not None:
        return {**_describe(SkillSummary.of(builtin)), "body": builtin.body}
    async with state.sessions() as session:
        summary = await skills.find_summary(session, tenant, name)
        body = await skills.skill_body(session, tenant, name) if summary else None
    if summary is None or body is None:
        raise not_found(name)
    return {**_describe(summary), "body": body}


@router.delete(
    "/skills/{name}",
    status_code=204,
    response_class=Response,
    responses=errors.responses(*errors.AUTHENTICATED, 404, 409),
    summary="Delete one of the tenant's skills",
)
async def delete_skill(state: StateDep, tenant: TenantDep, name: _NAME) -> Response:
    if name in skills.builtin_skills():
        raise ApiError(
            409,
            ErrorCode.SKILL_BUILTIN,
            f"{name!r} is a built-in skill: built-ins ship with the engine and cannot be deleted",
            {"skill": name},
        )
    async with state.sessions.begin() as session:
        deleted = await skills.delete_skill(session, tenant, name)
    if not deleted:
        raise not_found(name)
    return Response(status_code=204)
