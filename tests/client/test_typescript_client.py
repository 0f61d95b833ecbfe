"""The TypeScript client (clients/typescript) under ``node --test``, against a real engine.

``npm ci`` and ``npm run build`` run once per run (skipped, saying so,
without Node 18+ and npm), by whichever pytest-xdist worker needs the package
first; each test then runs node test files with the
session engine's address and a key in the environment. The cut test puts a
:class:`FaultProxy` between node and the gateway and resets every connection
through it, each time after node reported a new event (its progress file), so
every reset cuts a stream that is delivering.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from holdfast.testing.faultproxy import FaultProxy
from tests.processes import EngineProcesses

pytestmark = pytest.mark.timeout(180)

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "typescript"
# Which run built the package: pytest-xdist's workers share one run id, and the
# first to need the package builds it while the others wait on the lock (npm ci
# would delete node_modules under a worker already running node on it).
BUILT_BY = PACKAGE / "node_modules" / ".holdfast-test-run"
RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or secrets.token_hex(8)
CUTS = 40


def _node_major() -> int:
    node = shutil.which("node")
    if node is None:
        return 0
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    return int(version.strip().lstrip("v").split(".")[0] or 0)


@pytest.fixture(scope="session")
def ts_package() -> Path:
    """The package, installed from its lockfile and built."""
    if _node_major() < 18 or shutil.which("npm") is None:
        pytest.skip("the TypeScript client's tests need Node 18+ and npm")
    with (PACKAGE / ".holdfast-test-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if BUILT_BY.exists() and BUILT_BY.read_text() == RUN:
            return PACKAGE
        for command in (["npm", "ci", "--no-audit", "--no-fund"], ["npm", "run", "build"]):
            done = subprocess.run(command, cwd=PACKAGE, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                if command[1] == "ci" and "ENOTFOUND" in done.stderr + done.stdout:
                    pytest.skip(f"npm ci could not reach the registry: {done.stderr[-300:]}")
                pytest.fail(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
        BUILT_BY.write_text(RUN)
    return PACKAGE


def node_test(package: Path, files: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["node", "--test", *(f"test/{name}" for name in files)],
        cwd=package,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def passed(process: subprocess.Popen[str], timeout: float = 150) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    assert "# fail 0" in output and "# skipped 0" in output, output
    return output


def engine_env(engine: EngineProcesses, key: str) -> dict[str, str]:
    return {"HOLDFAST_URL": engine.url, "HOLDFAST_API_KEY": key}


def test_units_and_the_examples_type_check(ts_package: Path) -> None:
    passed(node_test(ts_package, ["units.test.mjs"], {}))
    # The examples use the types as a user would: narrowing on `type`, typed errors.
    checked = subprocess.run(
        ["npm", "run", "typecheck"], cwd=ts_package, capture_output=True, text=True, timeout=120
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_against_the_engine(
    ts_package: Path, engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    env = engine_env(engine, api_keys["main"])
    output = passed(node_test(ts_package, ["engine.test.mjs"], env))
    assert "# pass 7" in output, output


def test_ai_sdk_transport_read_by_the_ai_package(
    ts_package: Path, engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    env = engine_env(engine, api_keys["main"])
    output = passed(node_test(ts_package, ["ai-sdk.test.mjs"], env))
    assert "# pass 4" in output, output


def _last_progress(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def _cut_while_streaming(
    proxy: FaultProxy, progress: Path, node: subprocess.Popen[str], cuts: list[int]
) -> None:
    """Reset the proxy's connections each time node delivered another event,
    until node is done."""
    seen = ""
    while node.poll() is None:
        now = _last_progress(progress)
        if now and now != seen and not now.endswith("done\n"):
            seen = now
            if proxy.reset_all() > 0:
                cuts.append(int(now.split()[1]))
            continue
        time.sleep(0.002)  # polling node's progress file; nothing to signal on


@pytest.fixture
def proxy(engine: EngineProcesses) -> Iterator[FaultProxy]:
    port = urlsplit(engine.url).port
    assert port is not None
    with FaultProxy("127.0.0.1", port) as proxy:
        yield proxy


def test_a_stream_cut_forty_times_sees_every_event_once(
    ts_package: Path,
    engine: EngineProcesses,
    api_keys: dict[str, str],
    proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    progress = tmp_path / "progress"
    env = {
        **engine_env(engine, api_keys["main"]),
        "HOLDFAST_PROXY_URL": proxy.url_for(engine.url),
        "HOLDFAST_PROGRESS_FILE": str(progress),
    }
    node = node_test(ts_package, ["cuts.test.mjs"], env)
    cuts: list[int] = []
    cutter = threading.Thread(target=_cut_while_streaming, args=(proxy, progress, node, cuts))
    cutter.start()
    try:
        passed(node)
    finally:
        cutter.join()
    assert len(cuts) >= CUTS, cuts
