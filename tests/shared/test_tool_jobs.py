"""Jobs on ``Keys.tools``: one discriminated union read through one adapter
(``jobs.parse_tool_job``), and the jobs a previous version wrote (no ``kind``)
still read during a rolling upgrade."""

from __future__ import annotations

import json
from typing import Any

import pytest
from holdfast_shared.jobs import (
    AssetProbe,
    ToolCallJob,
    ToolJob,
    WorkspaceRemoval,
    WorkspaceRequest,
    parse_tool_job,
)
from holdfast_shared.keys import Keys
from redis.asyncio import Redis

JOBS: list[ToolJob] = [
    ToolCallJob(
        tenant_id="t",
        task_id="k",
        turn_id="u",
        tool_call_id="c",
        tool="bash",
        input={"command": "ls"},
        reply_to="inbox",
        skills=("pdf",),
    ),
    AssetProbe(tenant_id="t", server="files", reply_to="reply"),
    WorkspaceRemoval(tenant_id="t", task_id="k"),
    WorkspaceRequest(
        request_id="r", tenant_id="t", task_id="k", action="restore", archive_id="a", reply_to="x"
    ),
]


@pytest.mark.parametrize("job", JOBS, ids=lambda job: job.kind)
async def test_every_kind_reads_back_from_the_stream_as_written(
    job: ToolJob, redis: Redis, redis_prefix: str
) -> None:
    stream = Keys(f"{redis_prefix}tooljobs:").tools
    entry_id = await redis.xadd(stream, job.to_fields())
    [(read_id, fields)] = await redis.xrange(stream, min=entry_id, max=entry_id)
    assert read_id == entry_id
    assert json.loads(next(iter(fields.values())))["kind"] == job.kind
    assert parse_tool_job(fields) == job
    await redis.delete(stream)


def legacy_fields(job: ToolJob) -> dict[str, str]:
    """The entry the previous version wrote for ``job``: the same field, no ``kind``."""
    payload: dict[str, Any] = job.model_dump(mode="json", exclude={"kind"})
    return {job.FIELD: json.dumps(payload)}


@pytest.mark.parametrize("job", JOBS, ids=lambda job: job.kind)
def test_a_job_written_before_kind_existed_is_read_by_its_field(job: ToolJob) -> None:
    fields = legacy_fields(job)
    assert "kind" not in next(iter(fields.values()))
    assert parse_tool_job(fields) == job


def test_kind_wins_over_the_field() -> None:
    probe = AssetProbe(tenant_id="t", server="files", reply_to="reply")
    assert parse_tool_job({"job": probe.model_dump_json()}) == probe


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"other": "{}"},
        {"job": "not json"},
        {"job": "{}"},
        {"asset_probe": json.dumps({"tenant_id": "t"})},
        {"job": json.dumps({"kind": "no_such_kind", "tenant_id": "t"})},
    ],
)
def test_an_entry_without_a_job_that_parses_is_a_value_error(fields: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        parse_tool_job(fields)


@pytest.mark.parametrize("job", JOBS, ids=lambda job: job.kind)
def test_each_class_finds_only_its_own_kind(job: ToolJob) -> None:
    fields = job.to_fields()
    assert type(job).find(fields) == job
    models = (ToolCallJob, AssetProbe, WorkspaceRemoval, WorkspaceRequest)
    assert all(model.find(fields) is None for model in models if model is not type(job))
