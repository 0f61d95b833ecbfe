"""Ask a tool-runner to checkpoint or restore a task's workspace, and wait for it.

For the services that do not hold workspaces (the loop-worker, the gateway).
The request goes on ``Keys.tools``, where the task's tool calls go: every
tool-runner takes from that stream, and the one that takes the request
restores the task's head first if it lacks the workspace (see the tool-runner's
``checkpoints.py``). The answer comes back on a short-lived Redis list
(``Keys.workspace_reply``). A request id makes a redelivered request harmless:
the runner answers it from the first one's recorded result.
"""

from __future__ import annotations

import secrets

from redis.asyncio import Redis

from holdfast_shared.jobs import WorkspaceFiles, WorkspaceReply, WorkspaceRequest
from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import blpop_within


class WorkspaceRequestError(RuntimeError):
    """A tool-runner could not carry out the request; the message says why."""


class WorkspaceRequestTimeout(WorkspaceRequestError):
    """No tool-runner answered in time (none running, or all busy). The request
    may still be carried out later; doing so again is harmless."""


async def checkpoint_workspace(
    redis: Redis,
    keys: Keys,
    *,
    tenant_id: str,
    task_id: str,
    timeout: float = 30.0,  # noqa: ASYNC109 - the wait is a BLPOP's, not the caller's block
) -> str | None:
    """Archive the task's workspace now: the archive id (the previous one when
    nothing changed), None when the task has no workspace yet."""
    reply = await _request(redis, keys, tenant_id, task_id, "checkpoint", None, timeout)
    return reply.archive_id


async def restore_workspace(
    redis: Redis,
    keys: Keys,
    *,
    tenant_id: str,
    task_id: str,
    archive_id: str | None,
    timeout: float = 30.0,  # noqa: ASYNC109 - the wait is a BLPOP's, not the caller's block
) -> None:
    """Replace the task's workspace with the archive ``archive_id`` (one of this
    task's; None: an empty workspace). WorkspaceRequestError if it is not."""
    await _request(redis, keys, tenant_id, task_id, "restore", archive_id, timeout)


async def _request(
    redis: Redis,
    keys: Keys,
    tenant_id: str,
    task_id: str,
    action: str,
    archive_id: str | None,
    timeout: float,  # noqa: ASYNC109 - see above
) -> WorkspaceReply:
    request_id = secrets.token_hex(16)
    request = WorkspaceRequest(
        request_id=request_id,
        tenant_id=tenant_id,
        task_id=task_id,
        action="checkpoint" if action == "checkpoint" else "restore",
        archive_id=archive_id,
        reply_to=keys.workspace_reply(request_id),
    )
    answered = await ask_runner(redis, keys, request, timeout)
    if answered is None:
        raise WorkspaceRequestTimeout(
            f"no tool-runner answered the workspace {action} of task {task_id} within {timeout} s"
        )
    reply = WorkspaceReply.model_validate_json(answered)
    if reply.error is not None:
        raise WorkspaceRequestError(f"workspace {action} of task {task_id}: {reply.error}")
    return reply


async def ask_runner(
    redis: Redis,
    keys: Keys,
    request: WorkspaceRequest | WorkspaceFiles,
    timeout: float,  # noqa: ASYNC109 - see above
) -> str | None:
    """Send ``request`` to the tool-runners and wait for its answer on its
    ``reply_to`` list: the answer's JSON, None if none came within ``timeout``."""
    await redis.xadd(keys.tools, request.to_fields())
    try:
        answered = await blpop_within(redis, [request.reply_to], timeout)
    finally:
        # Nobody waits for a late answer: let it not linger.
        await redis.expire(request.reply_to, 60)
    return None if answered is None else answered[1]
