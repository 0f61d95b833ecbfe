"""``clients/typescript/src/generated/`` is what ``scripts/gen_types.py`` writes from
the gateway's OpenAPI description now: a change to an event, a request or an
answer that was not regenerated fails here (and so in CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from holdfast_shared.events import EVENT_TYPES

PACKAGE = Path(__file__).resolve().parents[2] / "clients" / "typescript"
SCRIPT = PACKAGE / "scripts" / "gen_types.py"


def test_generated_types_are_current(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    committed = PACKAGE / "src" / "generated"
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(p.name for p in committed.iterdir())
    for name in written:
        assert (tmp_path / name).read_text() == (committed / name).read_text(), (
            f"src/generated/{name} is stale: run "
            "`uv run python clients/typescript/scripts/gen_types.py`"
        )


def test_every_event_type_of_the_catalogue_is_generated() -> None:
    events = (PACKAGE / "src" / "generated" / "events.ts").read_text()
    listed = events.split("export const EVENT_TYPES = [", 1)[1].split("] as const", 1)[0]
    assert sorted(line.strip().strip('",') for line in listed.split()) == sorted(EVENT_TYPES)
