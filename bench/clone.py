"""A newcomer's first start, timed: fresh clone → ``holdfast up`` healthy (goal ≤ 30 s).

    uv run --group dev python -m bench.clone [--repo URL_OR_PATH] [--keep]

What the README's start command does on a new machine, measured from the
outside: ``git clone`` of this checkout's HEAD (or ``--repo``) into a
temporary directory, then ``uv run holdfast up`` there with an empty
``UV_CACHE_DIR`` (every package downloaded from the registry and installed),
a HOME and data directory of its own (so the embedded Redis and PostgreSQL,
first initdb and migrations included) and a free port, until ``GET /health``
says ``ok``. Then Ctrl-C (SIGINT to ``uv``, which passes it on) until the
process exits, and a second start from the same clone (the environment and
cache in place) until healthy: what the start itself costs.

The reference beside it, in the same run: the same third-party packages
(``uv export`` of the lock for the default groups) installed by
``uv venv && uv pip install -r`` into a virtualenv of its own, also from an
empty cache: the download-and-install floor that any start from nothing
pays. It needs the registry; the network's speed is most of both figures.
Opt-in, not a ``bench.run`` phase: it takes a minute and downloads ~100 MB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console

from bench.table import Row, render
from holdfast.testing.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 30.0
HEALTHY_WITHIN = 600.0
STOP_WITHIN = 60.0


def _uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    if found is None:
        raise SystemExit("uv is not on PATH")
    return found


def _clean_env(home: Path, cache: Path) -> dict[str, str]:
    """This process's environment as a new user's shell would have it: none of the
    bench's or a test run's HOLDFAST_ settings, no active virtualenv, an empty cache
    (uv's other settings, an index mirror say, stay: the registry must be reachable)."""
    dropped = ("VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT")
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_") and k not in dropped
    }
    env.update(HOME=str(home), UV_CACHE_DIR=str(cache))
    return env


def _count_packages(clone: Path) -> int:
    return sum(1 for _ in clone.glob(".venv/lib/python*/site-packages/*.dist-info"))


class _Start:
    """One ``uv run holdfast up`` in the clone, timed to healthy and to its exit."""

    def __init__(self, clone: Path, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        env = {**env, "HOLDFAST_PORT": str(self.port), "HOLDFAST_DATA_DIR": str(clone / "data")}
        self.started = time.monotonic()
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [_uv(), "run", "holdfast", "up"],
                cwd=clone,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.log = log

    def healthy(self) -> float:
        """Seconds from the command to ``GET /health`` answering ``ok``."""
        url = f"http://127.0.0.1:{self.port}/health"
        with httpx.Client(timeout=2) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"holdfast up exited: {self.log.read_text()[-2000:]}")
                try:
                    if http.get(url).json().get("status") == "ok":
                        return time.monotonic() - self.started
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() - self.started > HEALTHY_WITHIN:
                    raise TimeoutError(f"not healthy in {HEALTHY_WITHIN:.0f} s")
                time.sleep(0.1)

    def stop(self) -> float:
        """Seconds from Ctrl-C to the exit (killed, and an error, past ``STOP_WITHIN``)."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(STOP_WITHIN)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise TimeoutError(f"still running {STOP_WITHIN:.0f} s after Ctrl-C") from None
        return time.monotonic() - started


def _start_and_stop(clone: Path, env: dict[str, str], log: Path) -> tuple[float, float]:
    """Seconds to healthy, then from Ctrl-C to the exit."""
    start = _Start(clone, env, log)
    try:
        healthy = start.healthy()
    finally:
        stopped = start.stop()
    return healthy, stopped


def _timed(command: list[str], env: dict[str, str] | None = None) -> float:
    started = time.monotonic()
    subprocess.run(command, check=True, capture_output=True, env=env)
    return time.monotonic() - started


def _baseline(work: Path, clone: Path) -> tuple[float, int]:
    """``uv venv && uv pip install -r`` of the clone's default groups' third-party
    packages, from an empty cache: the seconds and the number of packages."""
    env = _clean_env(work / "home-baseline", work / "uv-cache-baseline")
    (work / "home-baseline").mkdir()
    export = [_uv(), "export", "--frozen", "--no-hashes", "--no-header", "--no-annotate"]
    export += ["--no-emit-workspace", "--no-emit-project"]
    exported = subprocess.run(
        export, cwd=clone, env=env, check=True, capture_output=True, text=True
    ).stdout
    requirements = work / "requirements.txt"
    requirements.write_text(exported)
    count = sum(1 for line in exported.splitlines() if line and not line.startswith(("#", "-")))
    venv = work / "baseline-venv"
    seconds = _timed([_uv(), "venv", "--quiet", str(venv)], env=env)
    seconds += _timed(
        [_uv(), "pip", "install", "--quiet", "--compile-bytecode", "-r", str(requirements)],
        env={**env, "VIRTUAL_ENV": str(venv)},
    )
    return seconds, count


def measure(repo: str, work: Path, console: Console) -> list[Row]:
    clone, home = work / "holdfast", work / "home"
    home.mkdir()
    env = _clean_env(home, work / "uv-cache")
    log = work / "up.log"
    rows: list[Row] = []

    console.print(f"cloning {repo} into {clone}…")
    clone_seconds = _timed(["git", "clone", "--quiet", repo, str(clone)])
    console.print("uv run holdfast up (empty uv cache)…")
    to_healthy, to_stop = _start_and_stop(clone, env, log)
    total = clone_seconds + to_healthy
    packages = _count_packages(clone)

    console.print("the same packages by uv pip install (empty cache)…")
    try:
        base, base_count = _baseline(work, clone)
    except (subprocess.CalledProcessError, OSError) as error:
        rows.append(Row.error("baseline: uv pip install", error))
        base, base_count = float("nan"), 0

    console.print("a second start of the same clone…")
    again, again_stop = _start_and_stop(clone, env, log)

    rows += [
        Row(
            "fresh clone → healthy",
            f"{total:.1f} s",
            base=f"{base:.1f} s",
            ratio=f"{total / base:.2f}x" if base == base else "",
            target=f"≤ {TARGET_SECONDS:.0f} s on 2 cores, registry reachable",
            detail=f"git clone {clone_seconds:.1f} s + `uv run holdfast up` to healthy "
            f"{to_healthy:.1f} s, installing {packages} distributions; baseline: "
            f"`uv venv && uv pip install` of the same {base_count} third-party packages, "
            "empty cache",
            ok=total <= TARGET_SECONDS,
        ),
        Row(
            "second start → healthy",
            f"{again:.1f} s",
            detail="the same clone, its .venv and uv cache in place: the embedded "
            "servers, migrations and the services' start-up",
        ),
        Row(
            "Ctrl-C → exit",
            f"{max(to_stop, again_stop):.1f} s",
            detail=f"the worse of the two stops ({to_stop:.1f} s, {again_stop:.1f} s): "
            "every service, then the embedded servers",
        ),
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.clone", description=__doc__)
    p.add_argument("--repo", default=str(ROOT), help="what to clone [this checkout]")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)
    console = Console(width=max(150, shutil.get_terminal_size((160, 40)).columns))
    # Short: the embedded Redis's unix socket lives under the data directory.
    work = Path(tempfile.mkdtemp(prefix="hfclone."))
    started = time.monotonic()
    try:
        rows = measure(args.repo, work, console)
    finally:
        if args.keep:
            console.print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    caption = (
        f"One run ({time.monotonic() - started:.0f} s): `git clone` of {args.repo} (its "
        "HEAD, not the work tree), then the README's start command with an empty "
        "UV_CACHE_DIR, a HOME of its own and the embedded servers."
    )
    console.print(render(rows, caption))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
