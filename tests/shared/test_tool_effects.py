"""Effect classes and idempotency keys: what each tool is taken for, and the key a call carries."""

from __future__ import annotations

import pytest
from holdfast_shared.agents import builtin_agents, check_effect_key, parse_agent_file
from holdfast_shared.assets.catalogue import annotation_effect, server_tools
from holdfast_shared.jobs import ToolCallJob, idempotency_key, parse_tool_job


@pytest.mark.parametrize(
    ("annotations", "effect"),
    [
        ({}, "effectful"),
        ({"readOnlyHint": True}, "read_only"),
        ({"idempotentHint": True}, "idempotent"),
        ({"idempotentHint": True, "destructiveHint": True}, "idempotent"),
        ({"destructiveHint": True}, "effectful"),
        ({"readOnlyHint": False, "idempotentHint": False}, "effectful"),
    ],
)
def test_mcp_annotations_give_the_class(annotations: dict[str, bool], effect: str) -> None:
    assert annotation_effect(annotations) == effect


def test_a_server_entry_and_an_agent_override_the_annotations() -> None:
    stored = [
        {"name": "look", "annotations": {"readOnlyHint": True}},
        {"name": "pay", "annotations": {}},
    ]
    look, pay = server_tools("bank", stored, {"pay": "idempotent"})
    assert (look.effect, pay.effect) == ("read_only", "idempotent")
    agent = builtin_agents()["general"].model_copy(update={"effects": {"bank__*": "effectful"}})
    assert agent.effect(pay.name, {}, pay) == "effectful"
    assert agent.effect(look.name, {}, look) == "effectful"


def test_builtin_classes_and_bash_patterns() -> None:
    agent = parse_agent_file(
        "---\nname: t\ndescription: d\ntools: [bash, read_file, write_file, edit_file]\n"
        "effects:\n  'bash:git status*': read_only\n  'bash:make *': idempotent\n---\nbody\n"
    )
    assert agent.effect("read_file", {"path": "a"}) == "read_only"
    assert agent.effect("write_file", {"path": "a", "content": ""}) == "idempotent"
    assert agent.effect("edit_file", {}) == "effectful"
    assert agent.effect("bash", {"command": "rm -rf x"}) == "effectful"
    assert agent.effect("bash", {"command": "git status --short"}) == "read_only"
    assert agent.effect("bash", {"command": "make all"}) == "idempotent"
    assert agent.tool_effects()["bash"] == "effectful"
    assert agent.tool_effects()["bash:make *"] == "idempotent"


@pytest.mark.parametrize("key", ["ask_user", "nope", "bash:"])
def test_effect_keys_name_a_classable_tool(key: str) -> None:
    with pytest.raises(ValueError):
        check_effect_key(key)


def test_the_key_is_stable_per_call_and_travels_with_the_job() -> None:
    ids = ("tenant", "task", "turn", "call-1")
    key = idempotency_key(*ids)
    assert key == idempotency_key(*ids) != idempotency_key("tenant", "task", "turn", "call-2")
    job = ToolCallJob(
        tenant_id="tenant",
        task_id="task",
        turn_id="turn",
        tool_call_id="call-1",
        tool="bash",
        input={},
        reply_to="inbox",
    )
    assert job.idempotency_key == key
    again = parse_tool_job({"job": job.model_dump_json()})
    retried = job.model_copy(update={"attempt": 2})
    assert isinstance(again, ToolCallJob) and again.idempotency_key == retried.idempotency_key
    # A job of the previous version (no key on it) derives the same one.
    legacy = job.model_dump(exclude={"idempotency_key", "attempt"})
    assert ToolCallJob.model_validate(legacy).idempotency_key == key
