"""Ask a tool-runner about a task's files, and turn its answer into the API's.

The gateway never touches a workspace: the tool-runners hold them, often on
other hosts. A :class:`~holdfast_shared.jobs.WorkspaceFiles` request goes on
``Keys.tools`` like a checkpoint request does (``workspace_checkpoints.requests``),
and the runner that takes it answers on a short-lived list (the runner's
``workspace_files.py``). An upload's bytes wait for it at a short-lived key
(``Keys.workspace_upload``), not in the stream, which keeps its entries.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any, Literal

from holdfast_shared.errors import ErrorCode
from holdfast_shared.jobs import WorkspaceFiles, WorkspaceFilesReply
from holdfast_shared.workspace_checkpoints.requests import ask_runner

from holdfast_gateway.errors import ApiError
from holdfast_gateway.state import GatewayState

# How long a tool-runner may take to answer (a hibernated workspace is restored first).
TIMEOUT_SECONDS = 30.0
# An upload's bytes outlive a request nobody took for this long.
_UPLOAD_TTL_SECONDS = 120

_STATUS = {
    "not_found": (404, ErrorCode.FILE_NOT_FOUND),
    "invalid_path": (400, ErrorCode.INVALID_PATH),
    # Well-formed, but the workspace holds the other kind there.
    "not_a_file": (409, ErrorCode.INVALID_PATH),
    "not_a_directory": (409, ErrorCode.INVALID_PATH),
    "full": (413, ErrorCode.WORKSPACE_FULL),
    "changed": (409, ErrorCode.FILE_NOT_FOUND),
}


async def ask_files(
    state: GatewayState,
    tenant_id: str,
    task_id: str,
    action: Literal["list", "read", "write", "delete"],
    *,
    upload: bytes | None = None,
    **fields: Any,
) -> WorkspaceFilesReply:
    """The runner's answer to ``action`` on the task's workspace; ApiError when it
    could not (its problem as 4xx, no runner answering as 503)."""
    request_id = secrets.token_hex(16)
    upload_key = None
    if upload is not None:
        upload_key = state.keys.workspace_upload(request_id)
        await state.redis.set(upload_key, base64.b64encode(upload), ex=_UPLOAD_TTL_SECONDS)
    request = WorkspaceFiles(
        request_id=request_id,
        tenant_id=tenant_id,
        task_id=task_id,
        action=action,
        upload_key=upload_key,
        reply_to=state.keys.workspace_reply(request_id),
        **fields,
    )
    try:
        answered = await ask_runner(state.redis, state.keys, request, TIMEOUT_SECONDS)
    finally:
        if upload_key is not None:
            await state.redis.delete(upload_key)
    if answered is None:
        raise ApiError(
            503,
            ErrorCode.UNAVAILABLE,
            f"no tool-runner answered within {TIMEOUT_SECONDS:.0f} s",
            headers={"Retry-After": "5"},
        )
    reply = WorkspaceFilesReply.model_validate_json(answered)
    if reply.error is not None:
        if reply.problem is None:
            raise ApiError(503, ErrorCode.UNAVAILABLE, reply.error, headers={"Retry-After": "5"})
        status, code = _STATUS[reply.problem]
        raise ApiError(status, code, reply.error, {"path": fields.get("path", "")})
    return reply
