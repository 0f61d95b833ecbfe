"""``GET /health``: liveness of the gateway and the servers it depends on.

Without a key it answers only ``{"status": "ok"|"degraded"}`` (200 or 503):
enough for load balancers, orchestrators' probes and ``holdfast up``, which hold
no key, and nothing about the deployment (runner host names, sandbox, landlock
and pgvector versions) for whoever can reach the port. With a valid
``X-Engine-Key`` it adds the uptime and each subsystem; a bad key is 401 (429
past the failure limit), as on every other route.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from holdfast_shared.liveness import (
    available_providers,
    default_models,
    live_runners,
    unavailable_models,
)
from holdfast_shared.memory import vectors
from holdfast_shared.modelspec import parse_model_spec
from pydantic import BaseModel
from sqlalchemy import text

from holdfast_gateway import errors
from holdfast_gateway.deps import StateDep, authenticate

router = APIRouter(tags=["health"])

_PROBE_TIMEOUT = 2.0


async def _probe(check: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        await asyncio.wait_for(check, _PROBE_TIMEOUT)
    except Exception as exc:
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"status": "ok", "latency_ms": round((time.perf_counter() - start) * 1000, 2)}


class Health(BaseModel):
    status: Literal["ok", "degraded"]
    # Only with a valid X-Engine-Key:
    uptime_seconds: float | None = None
    # redis, postgres: {"status": "ok"|"error", "latency_ms"|"error"}; fanout;
    # tool_runners: each live runner's sandbox; memory: how memories are searched
    # (full text, plus pgvector similarity where installed); models: the live
    # loop-workers' default provider:model (a turn that names none gets it),
    # the providers they serve and, where a worker cannot serve a model (its
    # context window too small), "unavailable": {provider:model: why} (and the
    # status is degraded: turns for it are refused).
    subsystems: dict[str, Any] | None = None


async def _models(state: Any) -> dict[str, Any]:
    # `holdfast chat` names the model in its header from this, before any turn runs.
    default, providers, unavailable = await asyncio.gather(
        default_models(state.redis, state.keys),
        available_providers(state.redis, state.keys),
        unavailable_models(state.redis, state.keys),
    )
    found: dict[str, Any] = {
        "default": sorted({_spelled(spec) for spec in default}),
        "providers": sorted(providers),
    }
    if unavailable:
        found["unavailable"] = unavailable
    return found


def _spelled(spec: str) -> str:
    """``provider:model`` as a turn's usage event names it (a worker may say ``scripted``)."""
    try:
        return str(parse_model_spec(spec))
    except ValueError:
        return spec


async def _memory(state: Any) -> dict[str, Any]:
    """How long-term memory is searched here: full text always, vectors where possible."""
    async with state.sessions() as session:
        support = await vectors.probe(session)
    embedder = state.settings.embedder
    with_vectors = support.available and embedder != "none"
    return {
        "search": "full text + vectors (reciprocal rank fusion)" if with_vectors else "full text",
        "embedder": embedder,
        "vectors": support.to_json()
        if embedder != "none"
        else {"status": "off", "reason": "HOLDFAST_EMBEDDER=none"},
    }


@router.get(
    "/health",
    responses={
        200: {"model": Health, "description": "Redis and PostgreSQL answer"},
        503: {"model": Health, "description": "Redis or PostgreSQL does not answer"},
        **errors.responses(401, 429, 500),
    },
    summary="Health of the gateway, Redis and PostgreSQL: the status without a key, "
    "each subsystem with one",
    # The key is optional here: {} is "no security", the other "with the key".
    openapi_extra={"security": [{}, {"EngineKey": []}]},
)
async def health(request: Request, state: StateDep) -> JSONResponse:
    key = request.headers.get("x-engine-key")
    if key:
        await authenticate(request, state, key)  # 401/429 for a bad one

    async def pg() -> None:
        async with state.sessions() as session:
            await session.execute(text("SELECT 1"))

    redis, postgres = await asyncio.gather(_probe(state.redis.ping()), _probe(pg()))
    ok = redis["status"] == "ok" and postgres["status"] == "ok"
    if not key:
        return JSONResponse({"status": "ok" if ok else "degraded"}, status_code=200 if ok else 503)
    subsystems: dict[str, Any] = {"redis": redis, "postgres": postgres, "fanout": state.hub.stats}
    if postgres["status"] == "ok":
        with contextlib.suppress(Exception):
            subsystems["memory"] = await asyncio.wait_for(_memory(state), _PROBE_TIMEOUT)
    if redis["status"] == "ok":
        # What each live tool-runner's sandbox can do; tools fail closed where it cannot.
        with contextlib.suppress(Exception):
            subsystems["tool_runners"] = await asyncio.wait_for(
                live_runners(state.redis, state.keys), _PROBE_TIMEOUT
            )
        with contextlib.suppress(Exception):
            subsystems["models"] = await asyncio.wait_for(_models(state), _PROBE_TIMEOUT)
    # A model no worker can serve degrades the engine, not the gateway: still 200.
    models_ok = not subsystems.get("models", {}).get("unavailable")
    body = {
        "status": "ok" if ok and models_ok else "degraded",
        "uptime_seconds": round(time.monotonic() - state.started_at, 3),
        "subsystems": subsystems,
    }
    return JSONResponse(body, status_code=200 if ok else 503)
