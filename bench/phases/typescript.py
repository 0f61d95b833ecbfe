"""TypeScript client overhead: events/s through ``@holdfast/client`` (typed events,
the resume cursor, ``turn_resumed`` applied) against a bare ``fetch`` reader that
only splits the body into SSE frames, on the same engine in the same run.

Two rows, as for the Python SDK: a live turn (each side streams a fresh,
identical scripted turn) and a replay of a stored turn from the log. The node
script (``bench/node/stream_rate.mjs``) interleaves the sides and keeps the best
of three each. Needs Node 18+ and npm (the package is built once with
``npm ci`` and ``npm run build``); without them the rows say so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from bench.context import Context
from bench.table import Row

TARGET_RATIO = 0.8
REPEATS = 3
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "typescript"
SCRIPT = ROOT / "bench" / "node" / "stream_rate.mjs"


def _built() -> str | None:
    """Why the package cannot be run here, or None once it is built."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "no Node and npm on this machine"
    if (PACKAGE / "dist" / "esm" / "index.js").exists():
        return None
    for command in (["npm", "ci", "--no-audit", "--no-fund"], ["npm", "run", "build"]):
        done = subprocess.run(
            command, cwd=PACKAGE, capture_output=True, text=True, timeout=600, check=False
        )
        if done.returncode != 0:
            return f"`{' '.join(command)}` failed: {done.stderr[-200:]}"
    return None


def run(ctx: Context) -> list[Row]:
    deltas = ctx.sizes.single_deltas
    ctx.set_workers(1, ctx.workers_for(1))
    ctx.pause("typescript")
    label = f"TypeScript client, turn of {deltas:,} deltas"
    ctx.say(label)
    rows: list[Row] = []
    with ctx.errors_to(rows, label):
        missing = _built()
        if missing is not None:
            raise RuntimeError(missing)
        done = subprocess.run(
            [
                "node",
                str(SCRIPT),
                str(PACKAGE),
                ctx.engine.gateway_url,
                ctx.engine.api_key,
                str(deltas),
                str(REPEATS),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-500:])
        rates = json.loads(done.stdout.strip().splitlines()[-1])
        for kind, how in (
            ("live", f"best of {REPEATS} fresh turns each"),
            ("replay", f"best of {REPEATS}, from the log"),
        ):
            measured = rates[kind]
            rows.append(
                _row(
                    f"TypeScript client, {kind} ({measured['events']:,} events)",
                    measured["sdk"],
                    measured["bare"],
                    how,
                )
            )
    return rows


def _row(label: str, client: float, bare: float, how: str) -> Row:
    ratio = client / bare
    return Row(
        label,
        f"{client:,.0f} events/s",
        f"{bare:,.0f} bare",
        f"{ratio:.2f}x",
        f"≥ {TARGET_RATIO}x bare fetch",
        f"{how}; the bare reader splits fetch's body into frames and counts them, the "
        "client yields typed events with its cursor, applying turn_resumed",
        ok=ratio >= TARGET_RATIO,
    )
