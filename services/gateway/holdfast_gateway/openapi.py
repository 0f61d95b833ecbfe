"""The API description (``/openapi.json``) and its interactive docs (``/docs``).

FastAPI writes the description from the routes. Added here: the event
catalogue (``holdfast_shared.events.Event``) as components, so that each
SSE response documents its frames — ``event`` the type, ``id`` the seq,
``data`` one event as JSON (:data:`SSE_CONTENT`); optional parameters
described as what is sent (a value, or nothing — never ``null``, which
FastAPI's ``X | None`` would otherwise allow); and ``/docs`` served with
the Swagger UI assets of the ``swagger-ui-bundle-v2`` package, so it loads
nothing from a CDN (``HOLDFAST_DOCS_ENABLED=false`` turns it off).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from holdfast_shared.events import EVENT_ADAPTER, EVENT_TYPES
from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]

_REF_TEMPLATE = "#/components/schemas/{model}"

SSE_CONTENT: dict[str, Any] = {
    "text/event-stream": {
        # Open API 3.1 has no keyword for one item of a stream: the schema of a
        # text/event-stream response describes each event, as tools read it.
        "schema": {
            "type": "object",
            "description": (
                "One Server-Sent Event. `event` is the type, `id` the event's seq "
                "(heartbeats have none) and `data` the event as flat JSON."
            ),
            "required": ["event", "data"],
            "properties": {
                "event": {"type": "string", "enum": sorted(EVENT_TYPES)},
                "id": {"type": "string", "pattern": "^[0-9]+$"},
                "data": {
                    "type": "string",
                    "contentMediaType": "application/json",
                    "contentSchema": {"$ref": _REF_TEMPLATE.format(model="Event")},
                },
            },
        }
    }
}
"""The ``content`` of a 200 response that is an event stream."""

# Every operation carries one of these (the routers' ``tags=``; a test holds
# each to it): ``/docs`` shows them as groups, in this order.
TAGS: list[dict[str, str]] = [
    {"name": "execute", "description": "Run a turn, follow or replay its events, cancel it"},
    {"name": "tasks", "description": "A tenant's tasks: status, turns, usage, messages, delete"},
    {"name": "hitl", "description": "Questions and permission prompts a turn waits on"},
    {"name": "executions", "description": "Long-running executions: start, pause, resume, stop"},
    {
        "name": "schedules",
        "description": "Messages sent as turns on a cron, an interval or once; their runs",
    },
    {"name": "files", "description": "A task's files: list, download, upload, delete"},
    {"name": "agents", "description": "The tenant's agents (built-in and custom)"},
    {"name": "skills", "description": "Skills an agent can call"},
    {"name": "assets", "description": "MCP servers and their stored credentials"},
    {"name": "memory", "description": "Long-term memory: the soul, facts, episodes, import/export"},
    {"name": "learning", "description": "How far the learning centre is behind"},
    {
        "name": "webhooks",
        "description": "Completion webhooks: the signing secret, the default, deliveries",
    },
    {"name": "auth", "description": "Stream tokens for clients that cannot send the key"},
    {"name": "health", "description": "Liveness and readiness"},
]


def operation_id(route: APIRoute) -> str:
    """Operations are named after their functions (``execute``, ``replay``…)."""
    return route.name


def _drop_null(schema: dict[str, Any]) -> None:
    """``anyOf: [X, null]`` becomes ``X``: a query or header value is never null."""
    branches = schema.get("anyOf")
    if not branches:
        return
    kept = [branch for branch in branches if branch.get("type") != "null"]
    if len(kept) == 1:
        del schema["anyOf"]
        schema.update(kept[0])
    else:
        schema["anyOf"] = kept


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Above this a float no longer holds every integer: its bound has been rounded.
_EXACT_FLOATS = 2**53


def _integer_bound(name: str, value: float) -> int:
    if value.is_integer() and abs(value) < _EXACT_FLOATS:
        return int(value)
    # The one bound this large is PostgreSQL's bigint (message ids), which the
    # float rounded up to 2**63: what was declared is 2**63 - 1.
    if name in ("maximum", "exclusiveMaximum") and value == float(2**63):
        return 2**63 - 1
    if name in ("minimum", "exclusiveMinimum") and value == -float(2**63):
        return -(2**63)
    raise ValueError(f"integer schema bound {name}={value!r} cannot be told exactly")


def _integer_bounds(node: Any) -> None:
    """Integer bounds written as integers, in place. FastAPI's OpenAPI model types
    ``maximum``/``minimum`` as floats, so the component schemas came out with
    ``1.0`` and ``9.223372036854776e+18`` (2**63, one past the declared bigint
    maximum): a client or fuzzer reading them sends values the API refuses."""
    if isinstance(node, list):
        for item in node:
            _integer_bounds(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for name in _BOUNDS:
            value = node.get(name)
            if isinstance(value, float):
                node[name] = _integer_bound(name, value)
    for value in node.values():
        _integer_bounds(value)


def install(app: FastAPI, *, docs: bool) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
                tags=TAGS,
            )
            for path in schema["paths"].values():
                for operation in path.values():
                    for parameter in operation.get("parameters", ()):
                        _drop_null(parameter["schema"])
            event = EVENT_ADAPTER.json_schema(ref_template=_REF_TEMPLATE)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(event.pop("$defs", {}))
            components["Event"] = event
            _integer_bounds(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    if not docs:
        return
    app.mount("/docs/assets", StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} API",
            swagger_js_url="/docs/assets/swagger-ui-bundle.js",
            swagger_css_url="/docs/assets/swagger-ui.css",
            swagger_favicon_url="/docs/assets/favicon-32x32.png",
        )
