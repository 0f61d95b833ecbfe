"""Where the POST→``started`` time goes, stage by stage, measured inside the gateway.

    uv run --group dev python -m bench.breakdown [--posts 300]

Runs the same sequential-POST workload as the latency row of ``bench.run``,
against a gateway process started through :func:`instrumented_main`: the real
gateway, with timing wrappers put around its functions at start-up (no engine
file is changed). Each ``/execute`` request gets a record of when it arrived,
how long each stage of ``start_turn`` took, and when its first body byte
(the ``started`` frame) was handed to the server; the client adds its own
send → ``started`` time, so what is left is the HTTP client and loopback.
"""

from __future__ import annotations

import argparse
import contextvars
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import harness, scenarios
from bench.context import run_async

OUT_ENV = "HOLDFAST_BENCH_BREAKDOWN_OUT"

_current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "bench_request", default=None
)
_out = Path(os.environ.get(OUT_ENV, os.devnull))


def _add(name: str, seconds: float) -> None:
    rec = _current.get()
    if rec is not None:
        rec[name] = rec.get(name, 0.0) + seconds


def _timed_async(name: str | Any, fn: Any) -> Any:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await fn(*args, **kwargs)
        finally:
            label = name(*args, **kwargs) if callable(name) else name
            _add(label, time.perf_counter() - start)

    return wrapper


def _timed_sync(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(name, time.perf_counter() - start)

    return wrapper


def _patch(obj: Any, attr: str, make: Any) -> None:
    """Wrap ``obj.attr`` if it exists (the engine changes; a missing stage is skipped)."""
    original = getattr(obj, attr, None)
    if original is not None:
        setattr(obj, attr, make(original))


def _save(rec: dict[str, float]) -> None:
    # Called after the stream ended, outside anything timed. (Uvicorn re-raises
    # SIGTERM after shutting down, so there is no atexit to rely on.)
    with _out.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def _install() -> None:
    import fastapi.dependencies.utils as fastapi_deps
    import holdfast_gateway.main as gateway_main
    import holdfast_gateway.routes.execute as execute_route
    import holdfast_gateway.turns as turns
    from holdfast_gateway.auth import KeyAuthenticator
    from holdfast_shared.eventlog import EventLog
    from holdfast_shared.turnlock import TurnLock
    from redis.asyncio import Redis
    from sqlalchemy.dialects.postgresql import _psycopg_common

    def start_turn(fn: Any) -> Any:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            rec = _current.get()
            if rec is not None:
                rec["handler_start"] = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                if rec is not None:
                    rec["handler_end"] = time.perf_counter()

        return wrapper

    _patch(execute_route, "start_turn", start_turn)
    _patch(KeyAuthenticator, "tenant", lambda fn: _timed_async("auth (key cache)", fn))
    _patch(
        turns,
        "_get_or_create_task",
        lambda fn: _timed_async("task upsert, in the transaction (PostgreSQL)", fn),
    )
    _patch(TurnLock, "acquire", lambda fn: _timed_async("turn lock SET NX (Redis)", fn))
    _patch(
        EventLog, "append_bodies", lambda fn: _timed_async("append 'started' (Redis script)", fn)
    )
    _patch(
        Redis,
        "xadd",
        lambda fn: _timed_async(
            lambda self, name, *a, **k: (
                "XADD turn job (Redis)" if str(name).endswith("turns") else "XADD other (Redis)"
            ),
            fn,
        ),
    )
    _patch(
        fastapi_deps,
        "run_in_threadpool",
        lambda fn: _timed_async("sync dependency in threadpool", fn),
    )
    _patch(
        _psycopg_common._PGDialect_common_psycopg,
        "do_ping",
        lambda fn: _timed_sync("pool pre-ping SELECT 1 (PostgreSQL)", fn),
    )

    original_create = gateway_main.create_app

    def create_app(settings: Any) -> Any:
        app = original_create(settings)

        async def asgi(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] != "/execute":
                await app(scope, receive, send)
                return
            rec: dict[str, float] = {"arrived": time.perf_counter()}
            token = _current.set(rec)

            async def timed_send(message: Any) -> None:
                if message["type"] == "http.response.start":
                    rec["headers_sent"] = time.perf_counter()
                elif message["type"] == "http.response.body" and message.get("body"):
                    rec.setdefault("first_body", time.perf_counter())
                await send(message)

            try:
                await app(scope, receive, timed_send)
            finally:
                _current.reset(token)
                _save(rec)

        return asgi

    gateway_main.create_app = create_app


def instrumented_main() -> None:
    """Entry point of the instrumented gateway process."""
    _install()
    from holdfast_gateway.main import main

    main()


STAGE_ORDER = (
    "arrival → handler (HTTP parse, body, validation, dependencies)",
    "sync dependency in threadpool",
    "auth (key cache)",
    "task upsert, in the transaction (PostgreSQL)",
    "turn lock SET NX (Redis)",
    "rest of the transaction: checkout, turn + message INSERTs, COMMIT",
    "append 'started' (Redis script)",
    "XADD turn job (Redis)",
    "pool pre-ping SELECT 1 (PostgreSQL)",
    "handler → first body byte (response object, SSE task group)",
    "server total: arrival → first body byte",
    "client + loopback (send → arrival, first byte → parsed)",
    "client total: send → 'started' parsed",
)


def derive(rec: dict[str, float], client_ms: float) -> dict[str, float]:
    ms = {k: v * 1000 for k, v in rec.items() if not k[0].islower() or " " in k}
    pre_handler = (rec["handler_start"] - rec["arrived"]) * 1000
    handler = (rec["handler_end"] - rec["handler_start"]) * 1000
    inside = sum(
        ms.get(k, 0.0)
        for k in (
            "task upsert, in the transaction (PostgreSQL)",
            "turn lock SET NX (Redis)",
            "append 'started' (Redis script)",
            "XADD turn job (Redis)",
        )
    )
    server = (rec["first_body"] - rec["arrived"]) * 1000
    out = dict(ms)
    out["arrival → handler (HTTP parse, body, validation, dependencies)"] = pre_handler
    out["rest of the transaction: checkout, turn + message INSERTs, COMMIT"] = handler - inside
    out["handler → first body byte (response object, SSE task group)"] = (
        rec["first_body"] - rec["handler_end"]
    ) * 1000
    out["server total: arrival → first body byte"] = server
    out["client + loopback (send → arrival, first byte → parsed)"] = client_ms - server
    out["client total: send → 'started' parsed"] = client_ms
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.breakdown", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--posts", type=int, default=300, help="sequential POSTs timed [300]")
    p.add_argument("--heartbeat", type=float, default=2.0, help="HOLDFAST_HEARTBEAT_SECONDS [2]")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="SECONDS",
        help="first wait up to SECONDS for the machine to be quiet (see bench.run) [0]",
    )
    args = p.parse_args(argv)
    if args.wait_quiet > 0:
        harness.wait_quiet(args.wait_quiet)
    console = Console(width=max(120, shutil.get_terminal_size((140, 40)).columns))
    engine = harness.Engine(
        redis_url=harness.redis_url(),
        admin_url=harness.admin_database_url(),
        heartbeat_seconds=args.heartbeat,
        worker_concurrency=64,
    )
    out = engine.log_dir / "breakdown.json"
    warmup = 10
    try:
        engine.open()
        engine.start_gateway(
            code="from bench.breakdown import instrumented_main; instrumented_main()",
            extra_env={OUT_ENV: str(out)},
        )
        engine.set_workers(1, 64)
        lat = run_async(
            lambda: scenarios.post_to_started(
                engine.gateway_url, engine.api_key, args.posts, warmup=warmup
            ),
            True,
        )
    finally:
        engine.close()
    lines = out.read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "first_body" in r][warmup:]
    shutil.rmtree(engine.log_dir, ignore_errors=True)
    if len(records) != len(lat.samples_ms):
        print(
            f"warning: {len(records)} server records for {len(lat.samples_ms)} requests",
            file=sys.stderr,
        )
    rows = [derive(r, c) for r, c in zip(records, lat.samples_ms, strict=False)]
    table = Table(title=f"POST→started, stage by stage ({len(rows)} sequential POSTs, ms)")
    for col in ("Stage", "p50", "p90", "p99", "mean"):
        table.add_column(col, justify="left" if col == "Stage" else "right")
    for stage in STAGE_ORDER:
        values = [r.get(stage, 0.0) for r in rows]
        pct = scenarios.percentile
        table.add_row(
            stage,
            *(
                f"{v:.2f}"
                for v in (
                    pct(values, 50),
                    pct(values, 90),
                    pct(values, 99),
                    sum(values) / len(values),
                )
            ),
        )
    console.print(table)
    console.print(
        "Stages inside the handler are nested in 'arrival → handler' (threadpool, "
        "auth) and in the txn rows (pre-ping); p50s of parts do not add up exactly."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
