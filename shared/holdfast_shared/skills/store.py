"""Finding and keeping skills: the built-ins (package folders) and a tenant's
own (the ``skills`` table).

A built-in's name is never a tenant's skill (the gateway refuses it), so a
name resolves to at most one skill: the built-in first. Another tenant's
skills are never found. A stored skill's files are a JSONB object of
``{path: base64}``: the checked folder, so nothing reads the uploaded
archive again, and the file list is read without the bytes.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any, TypeVar

from sqlalchemy import ARRAY, ColumnElement, Text, and_, delete, literal_column, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.db.models import SkillRecord
from holdfast_shared.skills.builtin import builtin_skills
from holdfast_shared.skills.format import Skill

# What a lookup makes of a skill: a summary, the whole skill, its name.
X = TypeVar("X")


@dataclass(frozen=True, slots=True)
class SkillSummary:
    """What a skill is without its bytes: for listings and the system prompt."""

    name: str
    description: str
    builtin: bool
    files: tuple[str, ...]
    size_bytes: int
    created_at: datetime | None = None
    updated_at: datetime | None = None

    @classmethod
    def of(cls, skill: Skill) -> SkillSummary:
        files = tuple(skill.files)
        return cls(skill.name, skill.description, skill.builtin, files, skill.size_bytes)


# The paths of a row's files, without reading their contents.
_FILE_NAMES = literal_column(
    'ARRAY(SELECT k FROM jsonb_object_keys(skills.files) AS k ORDER BY k COLLATE "C")',
    ARRAY(Text),
)
_SUMMARY_COLUMNS = (
    SkillRecord.name,
    SkillRecord.description,
    _FILE_NAMES,
    SkillRecord.size_bytes,
    SkillRecord.created_at,
    SkillRecord.updated_at,
)


def _summary(row: Any) -> SkillSummary:
    name, description, files, size, created, updated = row
    return SkillSummary(name, description, False, tuple(files or ()), size, created, updated)


def from_record(row: SkillRecord) -> Skill:
    """The skill a stored row holds."""
    files = {path: base64.b64decode(data) for path, data in sorted(row.files.items())}
    return Skill(row.name, row.description, row.body, MappingProxyType(files), builtin=False)


def record_values(skill: Skill) -> dict[str, Any]:
    """The row's columns for ``skill`` (all but the tenant and the times)."""
    return {
        "name": skill.name,
        "description": skill.description,
        "body": skill.body,
        "files": {path: base64.b64encode(data).decode() for path, data in skill.files.items()},
        "size_bytes": skill.size_bytes,
        "digest": skill.digest,
    }


async def tenant_skills(session: AsyncSession, tenant_id: str) -> list[SkillSummary]:
    """The tenant's own skills, by name (without their bytes)."""
    rows = await session.execute(
        select(*_SUMMARY_COLUMNS)
        .where(SkillRecord.tenant_id == tenant_id)
        .order_by(SkillRecord.name)
    )
    return [_summary(row) for row in rows]


async def find_skill(session: AsyncSession, tenant_id: str, name: str) -> Skill | None:
    """The skill ``name`` as the tenant sees it: a built-in, else its own, else None."""
    builtin = builtin_skills().get(name)
    if builtin is not None:
        return builtin
    row = await session.get(SkillRecord, (tenant_id, name))
    return None if row is None else from_record(row)


async def find_summary(session: AsyncSession, tenant_id: str, name: str) -> SkillSummary | None:
    """:func:`find_skill` without the bytes."""
    found = await summaries(session, tenant_id, [name])
    return found[0] if found else None


async def skill_body(session: AsyncSession, tenant_id: str, name: str) -> str | None:
    """The instructions of the tenant's own skill ``name`` (None: it has none)."""
    return await session.scalar(
        select(SkillRecord.body).where(SkillRecord.tenant_id == tenant_id, SkillRecord.name == name)
    )


async def _resolved(
    names: Iterable[str],
    builtin: Callable[[Skill], X],
    own: Callable[[list[str]], Awaitable[Iterable[tuple[str, X]]]],
) -> dict[str, X]:
    """The skills among ``names`` the tenant has, in ``names``' order, once each:
    a built-in made by ``builtin``, the others as ``own`` reads them (asked only
    for names that are no built-in, and not at all when there are none)."""
    wanted = list(dict.fromkeys(names))
    builtins = builtin_skills()
    others = [name for name in wanted if name not in builtins]
    stored = dict(await own(others)) if others else {}
    resolved: dict[str, X] = {}
    for name in wanted:
        if name in builtins:
            resolved[name] = builtin(builtins[name])
        elif name in stored:
            resolved[name] = stored[name]
    return resolved


def _named(tenant_id: str, names: list[str]) -> ColumnElement[bool]:
    return and_(SkillRecord.tenant_id == tenant_id, SkillRecord.name.in_(names))


async def summaries(
    session: AsyncSession, tenant_id: str, names: Sequence[str]
) -> list[SkillSummary]:
    """The skills among ``names`` the tenant has (built-in or its own), in
    ``names``' order, once each; the others are left out."""

    async def own(names: list[str]) -> Iterable[tuple[str, SkillSummary]]:
        rows = await session.execute(select(*_SUMMARY_COLUMNS).where(_named(tenant_id, names)))
        return ((summary.name, summary) for summary in map(_summary, rows))

    return list((await _resolved(names, SkillSummary.of, own)).values())


async def load_skills(session: AsyncSession, tenant_id: str, names: Sequence[str]) -> list[Skill]:
    """The whole skills among ``names`` the tenant has, in order; others left out."""

    async def own(names: list[str]) -> Iterable[tuple[str, Skill]]:
        rows = await session.scalars(select(SkillRecord).where(_named(tenant_id, names)))
        return ((row.name, from_record(row)) for row in rows)

    return list((await _resolved(names, lambda skill: skill, own)).values())


async def unknown_skills(session: AsyncSession, tenant_id: str, names: Iterable[str]) -> list[str]:
    """The names among ``names`` that are no skill of the tenant (built-in or
    its own), in order, once each."""
    wanted = list(dict.fromkeys(names))

    async def own(names: list[str]) -> Iterable[tuple[str, str]]:
        found = await session.scalars(select(SkillRecord.name).where(_named(tenant_id, names)))
        return ((name, name) for name in found)

    known = await _resolved(wanted, lambda skill: skill.name, own)
    return [name for name in wanted if name not in known]


async def create_skill(session: AsyncSession, tenant_id: str, skill: Skill) -> SkillSummary | None:
    """Store ``skill`` as the tenant's; None when it has one of that name already.
    (A built-in's name is the caller's to refuse.)"""
    row = (
        await session.execute(
            insert(SkillRecord)
            .values(tenant_id=tenant_id, **record_values(skill))
            .on_conflict_do_nothing()
            .returning(*_SUMMARY_COLUMNS)
        )
    ).first()
    return None if row is None else _summary(row)


async def delete_skill(session: AsyncSession, tenant_id: str, name: str) -> bool:
    """Delete the tenant's skill ``name``; whether there was one."""
    deleted = await session.scalar(
        delete(SkillRecord)
        .where(SkillRecord.tenant_id == tenant_id, SkillRecord.name == name)
        .returning(SkillRecord.name)
    )
    return deleted is not None
