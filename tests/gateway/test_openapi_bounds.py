"""``/openapi.json`` writes integer bounds as integers.

FastAPI's OpenAPI model reads ``minimum``/``maximum`` as floats: the message ids'
bigint maximum came out as ``9.223372036854776e+18`` (2**63), so a client or the
fuzzer reading the description sent 2**63 and got a 422 the schema had not
announced (security issue #23, defect 7).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
from holdfast_gateway.app import create_app
from holdfast_shared.settings import Settings

_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _schemas(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _schemas(value, f"{path}/{key}")
    elif isinstance(node, list):
        for n, value in enumerate(node):
            yield from _schemas(value, f"{path}/{n}")


async def _description() -> dict[str, Any]:
    app = create_app(Settings(redis_url="redis://unused", database_url="postgresql://u/u"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    # Parsed from the text: json keeps 1.0 a float and 1 an int, as a client sees them.
    spec: dict[str, Any] = json.loads(response.text)
    return spec


async def test_every_integer_bound_is_an_integer() -> None:
    spec = await _description()
    floats = []
    checked = 0
    for path, schema in _schemas(spec):
        if schema.get("type") != "integer":
            continue
        for name in _BOUNDS:
            if name in schema:
                checked += 1
                if not isinstance(schema[name], int) or isinstance(schema[name], bool):
                    floats.append(f"{path}/{name} = {schema[name]!r}")
    assert not floats, floats
    assert checked > 10, "the walk found the integer schemas"


async def test_the_message_ids_are_bounded_by_the_bigint_maximum() -> None:
    request = (await _description())["components"]["schemas"]["ExecuteRequest"]["properties"]
    for field in ("edit_message_id", "retry_message_id"):
        assert request[field]["minimum"] == 1
        assert request[field]["maximum"] == 2**63 - 1, "exact, not rounded up to 2**63"
