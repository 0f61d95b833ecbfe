"""Each attempt of a tool call runs at most once (#26), against real PostgreSQL and
Redis: a call whose runner is gone is stored ``unknown`` (never run again by the
runner that finds it), only the next numbered attempt claims it again, and a
finished call answers every later delivery from its row."""

from __future__ import annotations

import secrets
from pathlib import Path

from holdfast_shared.jobs import ToolCallJob, ToolOutcome
from holdfast_shared.keys import Keys
from holdfast_tool_runner.executor import ToolExecutor
from holdfast_tool_runner.workspaces import Workspaces
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

NOT_HERE = "MCP servers are not available on this tool-runner"


def _executor(
    redis: Redis, keys: Keys, sessions: async_sessionmaker[AsyncSession], root: Path, runner: str
) -> ToolExecutor:
    # No connectors: a server tool's call "runs" at once with a known error, no sandbox.
    return ToolExecutor(redis, keys, sessions, Workspaces(root), runner)


async def test_an_attempt_runs_once_and_only_the_next_one_follows_an_unknown(
    redis: Redis,
    redis_prefix: str,
    sessions: async_sessionmaker[AsyncSession],
    tmp_path: Path,
) -> None:
    keys = Keys(f"{redis_prefix}attempts:")
    job = ToolCallJob(
        tenant_id="t1",
        task_id=f"task-{secrets.token_hex(4)}",
        turn_id="turn-1",
        tool_call_id="call-1",
        tool="bank__pay",
        input={"amount": 5},
        reply_to=f"{redis_prefix}attempts:inbox",
        server="bank",
        server_tool="pay",
    )
    # A runner that claimed attempt 1 and died (no liveness key of its own).
    dead = _executor(redis, keys, sessions, tmp_path / "dead", "runner-dead")
    assert await dead._claim(job)
    live = _executor(redis, keys, sessions, tmp_path / "live", "runner-live")

    lost = await live._outcome(job)
    assert lost.unknown is not None and lost.unknown.attempt == 1
    assert lost.unknown.sent_at is not None and lost.unknown.runner_lost_at is not None
    assert lost.unknown.sent_at <= lost.unknown.runner_lost_at
    # Redelivered: the same account, nothing run.
    assert (await live._outcome(job)).unknown == lost.unknown

    retry = job.model_copy(update={"attempt": 2})
    ran = await live._outcome(retry)
    assert ran == ToolOutcome(error=NOT_HERE)
    # Neither attempt runs again: the stored result answers both.
    assert not await live._claim(retry) and not await live._claim(job)
    assert await live._outcome(job) == ran
    assert not await live._claim(job.model_copy(update={"attempt": 3})), "done is final"
