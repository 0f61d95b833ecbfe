"""The Python client's event catalogue against the engine's.

``clients/python/holdfast_client/events.py`` copies
``shared/holdfast_shared/events.py`` by hand: the client is published alone
and must not import the engine's packages. Nothing else ties the two, so an
event type or field added to the engine and forgotten in the client would
reach users as an :class:`UnknownEvent` or a field only in ``model_extra``.
The engine's catalogue is the source of truth; these tests compare them by
introspection, so no list here needs updating when the catalogue grows.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from holdfast_client import events as client
from holdfast_shared import events as engine
from pydantic import BaseModel, TypeAdapter, ValidationError

CLIENT_PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "python" / "holdfast_client"
# What the engine is made of: the client installs without any of them.
ENGINE_PACKAGES = {
    "holdfast",
    "holdfast_shared",
    "holdfast_gateway",
    "holdfast_loop_worker",
    "holdfast_tool_runner",
    "holdfast_learning",
}

ENGINE_MODELS: dict[str, type[BaseModel]] = {
    model.model_fields["type"].default: model for model in engine.EVENT_MODELS
}
CLIENT_MODELS: dict[str, type[BaseModel]] = dict(client._MODELS)


def _admits_none(annotation: Any) -> bool:
    try:
        TypeAdapter(annotation).validate_python(None)
    except ValidationError:
        return False
    return True


def _shape(annotation: Any) -> Any:
    """An annotation with each model in it (``SubagentOrigin``, written on both
    sides) replaced by its name and fields: the same shape, whoever declares it."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        fields = annotation.model_fields.items()
        return (
            annotation.__name__,
            tuple(sorted((n, _shape(f.annotation), f.is_required()) for n, f in fields)),
        )
    args = get_args(annotation)
    if args:
        return (get_origin(annotation), tuple(_shape(arg) for arg in args))
    return annotation


def _wire_required(model: type[BaseModel]) -> set[str]:
    """The fields every wire JSON of ``model`` carries.

    ``body_json`` leaves out None-valued fields (but the type's ``KEEP_NULL``),
    so a required field whose type admits None — ``tool_result``'s ``output:
    Any``, None for a failed call — can be missing on the wire, and a client
    that required it would reject such events.
    """
    keep_null: frozenset[str] = getattr(model, "KEEP_NULL", frozenset())
    return {
        name
        for name, field in model.model_fields.items()
        if field.is_required() and (name in keep_null or not _admits_none(field.annotation))
    }


def test_the_same_event_types() -> None:
    missing = sorted(set(ENGINE_MODELS) - set(CLIENT_MODELS))
    extra = sorted(set(CLIENT_MODELS) - set(ENGINE_MODELS))
    assert not missing, f"event types the client does not know: {missing}"
    assert not extra, f"event types only the client has: {extra}"
    assert client.EVENT_TYPES == engine.EVENT_TYPES


def test_the_client_unions_hold_every_model() -> None:
    # The client lists its models three times (the discriminated union, the
    # public union, the parse table): a type added to one list only would
    # parse differently with and without the SSE frame's ``event:`` field.
    known = set(get_args(get_args(client.KnownEvent)[0]))
    assert known == set(CLIENT_MODELS.values())
    assert set(get_args(client.Event)) == known | {client.UnknownEvent}


@pytest.mark.parametrize("event_type", sorted(ENGINE_MODELS))
def test_the_same_fields(event_type: str) -> None:
    theirs = ENGINE_MODELS[event_type].model_fields
    ours = CLIENT_MODELS[event_type].model_fields
    assert set(ours) == set(theirs), (
        f"{event_type}: missing in the client {sorted(set(theirs) - set(ours))}, "
        f"only in the client {sorted(set(ours) - set(theirs))}"
    )
    for name, field in theirs.items():
        assert _shape(ours[name].annotation) == _shape(field.annotation), (
            f"{event_type}.{name}: client {ours[name].annotation!r}, engine {field.annotation!r}"
        )
        if not field.is_required():
            assert not ours[name].is_required(), f"{event_type}.{name} is optional in the engine"
            assert ours[name].default == field.default, f"{event_type}.{name}: another default"


@pytest.mark.parametrize("event_type", sorted(ENGINE_MODELS))
def test_the_client_requires_what_the_wire_always_carries(event_type: str) -> None:
    required = {
        name
        for name, field in CLIENT_MODELS[event_type].model_fields.items()
        if field.is_required()
    }
    wire = _wire_required(ENGINE_MODELS[event_type])
    assert required == wire, (
        f"{event_type}: the client requires {sorted(required)}, the wire always has {sorted(wire)}"
    )


def test_extra_fields_are_kept_on_both_sides() -> None:
    # A newer server's field must reach the client's model_extra, not an error.
    assert client.BaseEvent.model_config.get("extra") == "allow"
    for event_type, model in CLIENT_MODELS.items():
        assert model.model_config.get("extra") == "allow", event_type


def test_a_failed_tool_result_as_the_engine_writes_it_parses_in_the_client() -> None:
    body = engine.body_json(engine.ToolResult(tool_call_id="c1", output=None, error="denied"))
    wire = engine.envelope_json("t1", "u1", 7, 1_700_000_000_000, body)
    assert '"output"' not in wire
    event = client.parse_event(wire, "tool_result")
    assert isinstance(event, client.ToolResult)
    assert (event.output, event.error, event.seq) == (None, "denied", 7)


def test_the_client_imports_no_engine_package() -> None:
    for file in CLIENT_PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            roots = {name.split(".")[0] for name in names}
            assert not roots & ENGINE_PACKAGES, f"{file.name} imports {sorted(roots)}"
