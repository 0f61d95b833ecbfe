"""A task's files over HTTP: list, download, upload and delete what is in its
workspace, and list and download the files of an execution's checkpoint.

``/tasks/{task_id}/files``:
* ``GET ?path=&recursive=`` lists a directory (name, kind, size, sha256,
  modified, and the download path of each file);
* ``GET /{path}`` downloads a file, streamed in chunks, with ``Range``;
* ``PUT /{path}`` writes the request's body as the file (its directories made),
  capped by ``HOLDFAST_MAX_BODY_BYTES`` and the workspace's room;
* ``DELETE /{path}`` removes a file, a symlink or a directory with what it holds.

A task's files may be read while a turn runs. They are written and deleted only
between turns (409 ``TURN_IN_PROGRESS``), except under ``inputs/``: a client may
hand a running agent an input there, never take a file from under it elsewhere.

The gateway never touches a workspace: a tool-runner does the work
(``workspacefiles.py``), restoring a hibernated workspace first, and never
follows a symlink (a path through one is 404 ``FILE_NOT_FOUND``). A path that
is absolute or has ``.`` or ``..`` is 400 ``INVALID_PATH`` before anything is asked.

``/v1/execution/{id}/checkpoints/{checkpoint_id}/files`` does the same reads
for the workspace as the checkpoint archived it: listed from its manifest here,
its files' bytes read from the archive store by a tool-runner.
"""

from __future__ import annotations

import base64
import mimetypes
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from urllib.parse import quote

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from holdfast_shared.errors import ErrorCode
from holdfast_shared.executions import store as executions
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.jobs import WorkspaceFile
from holdfast_shared.workspace_checkpoints import ManifestError, store_from_settings
from holdfast_shared.workspace_checkpoints.manifest import check_path
from pydantic import BaseModel

from holdfast_gateway import errors
from holdfast_gateway.deps import StateDep, TenantDep, require_task
from holdfast_gateway.errors import ApiError
from holdfast_gateway.state import GatewayState
from holdfast_gateway.storagequota import check_storage
from holdfast_gateway.tasks import TaskRef
from holdfast_gateway.workspacefiles import ask_files

router = APIRouter(tags=["files"])

# Bytes asked of a tool-runner at a time while a download streams.
CHUNK_BYTES = 4 * 1024 * 1024
# Where a client may write while a turn runs.
INPUTS_DIR = "inputs"

TaskPath = Annotated[str, Path(pattern=ID_PATTERN)]
# A relative path: names of at most 255 characters between single slashes, none
# of them "." or "..", no backslash or NUL (a trailing slash is let through).
_NAME = r"(?:[^/\\\x00.][^/\\\x00]{0,254}|\.[^/\\\x00.][^/\\\x00]{0,253}|\.\.[^/\\\x00]{1,253})"
PATH_PATTERN = rf"^{_NAME}(?:/{_NAME})*/?$"
FilePath = Annotated[
    str,
    Path(
        max_length=4096,
        pattern=PATH_PATTERN,
        description="the file's path in the workspace (`a/b.txt`)",
    ),
]
DirQuery = Annotated[
    str,
    Query(
        max_length=4096,
        pattern=rf"^$|{PATH_PATTERN}",
        description="the directory to list (default: the workspace)",
    ),
]
Recursive = Annotated[bool, Query(description="list everything below the directory")]


# A download's bytes come with the file's own content type (from its name).
_BYTES = {"content": {"*/*": {"schema": {"type": "string", "format": "binary"}}}}
_DOWNLOAD_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {**_BYTES, "description": "The file's bytes"},
    206: {**_BYTES, "description": "The bytes of the Range asked for (`Content-Range`)"},
    **errors.responses(*errors.AUTHENTICATED, 400, 404, 409, 416),
}


class FileInfo(BaseModel):
    """One entry of a workspace."""

    path: str
    name: str
    kind: Literal["file", "dir", "link"]
    size: int
    sha256: str | None
    modified: datetime
    # The path that downloads it, relative to the API's base URL (files only).
    download: str | None


class FileList(BaseModel):
    task_id: str
    path: str
    files: list[FileInfo]


def _checked(path: str) -> str:
    """``path`` without a trailing slash, if it stays inside the workspace; else 400."""
    path = path.rstrip("/")
    if not path:
        return ""
    try:
        return check_path(path)
    except ManifestError as exc:
        raise ApiError(400, ErrorCode.INVALID_PATH, str(exc), {"path": path}) from None


def _info(entry: WorkspaceFile, base: str) -> FileInfo:
    return FileInfo(
        path=entry.path,
        name=entry.path.rsplit("/", 1)[-1],
        kind=entry.kind,
        size=entry.size,
        sha256=entry.sha256,
        modified=datetime.fromtimestamp(entry.mtime_ns / 1e9, UTC),
        download=f"{base}/{quote(entry.path)}" if entry.kind == "file" else None,
    )


# -- a task's workspace ----------------------------------------------------------------


@router.get(
    "/tasks/{task_id}/files",
    responses=errors.responses(*errors.AUTHENTICATED, 400, 404, 409),
    summary="List a directory of the task's workspace",
)
async def list_files(
    state: StateDep,
    tenant: TenantDep,
    task_id: TaskPath,
    path: DirQuery = "",
    recursive: Recursive = False,
) -> FileList:
    directory = _checked(path)
    task = await require_task(state, tenant, task_id)
    reply = await ask_files(state, tenant, task.id, "list", path=directory, recursive=recursive)
    base = f"/tasks/{task.name}/files"
    return FileList(
        task_id=task.name, path=directory, files=[_info(e, base) for e in reply.entries]
    )


@router.get(
    "/tasks/{task_id}/files/{path:path}",
    responses=_DOWNLOAD_RESPONSES,
    response_class=Response,
    summary="Download a file of the task's workspace (Range supported)",
)
async def download_file(
    state: StateDep, tenant: TenantDep, task_id: TaskPath, path: FilePath, request: Request
) -> Response:
    checked = _checked(path)
    if not checked:
        raise ApiError(400, ErrorCode.INVALID_PATH, "the workspace itself is not a file")
    task = await require_task(state, tenant, task_id)
    first = await ask_files(state, tenant, task.id, "read", path=checked, length=0)
    return _download(state, tenant, task.id, first.entries[0], request, archive_id=None)


@router.put(
    "/tasks/{task_id}/files/{path:path}",
    status_code=201,
    responses=errors.responses(*errors.AUTHENTICATED, 400, 404, 409, 413, 507),
    openapi_extra={
        # No body is a file of no bytes, as with any object store's PUT: not an
        # error, so the description does not call the body required.
        "requestBody": {
            "required": False,
            "description": "The file's bytes; none writes an empty file.",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        }
    },
    summary="Upload a file into the task's workspace (its directories made)",
)
async def upload_file(
    state: StateDep, tenant: TenantDep, task_id: TaskPath, path: FilePath, request: Request
) -> FileInfo:
    task, checked = await _writable(state, tenant, task_id, path)
    await check_storage(state, tenant)
    # Capped by the body limit (bodylimit.py) as it arrives; the runner refuses
    # what its workspace has no room for.
    body = await request.body()
    if len(body) > state.settings.workspace_max_bytes:
        raise ApiError(
            413,
            ErrorCode.WORKSPACE_FULL,
            "the file is larger than a workspace (HOLDFAST_WORKSPACE_MAX_BYTES)",
            {"limit_bytes": state.settings.workspace_max_bytes},
        )
    reply = await ask_files(state, tenant, task.id, "write", path=checked, upload=body)
    return _info(reply.entries[0], f"/tasks/{task.name}/files")


@router.delete(
    "/tasks/{task_id}/files/{path:path}",
    status_code=204,
    responses=errors.responses(*errors.AUTHENTICATED, 400, 404, 409),
    summary="Delete a file or directory of the task's workspace",
)
async def delete_file(
    state: StateDep, tenant: TenantDep, task_id: TaskPath, path: FilePath
) -> Response:
    task, checked = await _writable(state, tenant, task_id, path)
    await ask_files(state, tenant, task.id, "delete", path=checked)
    return Response(status_code=204)


async def _writable(
    state: GatewayState, tenant: str, task_id: str, path: str
) -> tuple[TaskRef, str]:
    """The task and the checked path, if the task may be written there now: a running turn's
    workspace only under ``inputs/`` (409 elsewhere)."""
    checked = _checked(path)
    if not checked:
        raise ApiError(400, ErrorCode.INVALID_PATH, "the workspace itself is not a file")
    task = await require_task(state, tenant, task_id)
    running = await state.lock.holder(task.id)
    if running is not None and not checked.startswith(f"{INPUTS_DIR}/"):
        raise ApiError(
            409,
            ErrorCode.TURN_IN_PROGRESS,
            f"task {task.name!r} has a running turn: only {INPUTS_DIR}/ may be written now",
            {"task_id": task.name, "turn_id": running, "path": checked},
        )
    return task, checked


# -- an execution's checkpoint ---------------------------------------------------------


async def _checkpoint_archive(
    state: GatewayState, tenant: str, execution_id: str, checkpoint_id: str
) -> tuple[str, str]:
    """(task id, archive id) of the checkpoint's workspace; 404 when there is none."""
    async with state.sessions() as session:
        row = await executions.find(session, tenant, execution_id)
        if row is None:
            raise ApiError(
                404,
                ErrorCode.EXECUTION_NOT_FOUND,
                f"execution {execution_id!r} not found",
                {"execution_id": execution_id},
            )
        found = await executions.checkpoints_of(session, [row.id])
    checkpoint = next((c for c in found[row.id] if c.id == checkpoint_id), None)
    if checkpoint is None or checkpoint.workspace_archive_id is None:
        raise ApiError(
            404,
            ErrorCode.CHECKPOINT_NOT_FOUND,
            f"execution {execution_id!r} has no checkpoint {checkpoint_id!r} with files",
            {"execution_id": execution_id, "checkpoint_id": checkpoint_id},
        )
    return row.task_id, checkpoint.workspace_archive_id


CheckpointFiles = "/v1/execution/{execution_id}/checkpoints/{checkpoint_id}/files"


@router.get(
    CheckpointFiles,
    responses=errors.responses(*errors.AUTHENTICATED, 400, 404),
    summary="List a directory of the workspace as a checkpoint archived it",
)
async def list_checkpoint_files(
    state: StateDep,
    tenant: TenantDep,
    execution_id: TaskPath,
    checkpoint_id: TaskPath,
    path: DirQuery = "",
    recursive: Recursive = False,
) -> FileList:
    directory = _checked(path)
    task_id, archive_id = await _checkpoint_archive(state, tenant, execution_id, checkpoint_id)
    archives = store_from_settings(state.settings.workspace_store, state.sessions)
    manifest = await archives.manifest(tenant, task_id, archive_id)
    if manifest is None:
        raise ApiError(404, ErrorCode.CHECKPOINT_NOT_FOUND, "the checkpoint's files are gone")
    if directory and (
        directory not in manifest.entries or manifest.entries[directory].kind != "dir"
    ):
        raise ApiError(
            404, ErrorCode.FILE_NOT_FOUND, f"{directory!r} is not a directory of the checkpoint"
        )
    prefix = f"{directory}/" if directory else ""
    base = CheckpointFiles.format(execution_id=execution_id, checkpoint_id=checkpoint_id)
    files = [
        _info(
            WorkspaceFile(
                path=rel,
                kind=entry.kind,
                size=entry.size,
                sha256=entry.sha256 or None,
                mtime_ns=entry.mtime_ns,
            ),
            base,
        )
        for rel, entry in sorted(manifest.entries.items())
        if rel.startswith(prefix) and (recursive or "/" not in rel[len(prefix) :])
    ]
    return FileList(task_id=execution_id, path=directory, files=files)


@router.get(
    CheckpointFiles + "/{path:path}",
    responses=_DOWNLOAD_RESPONSES,
    response_class=Response,
    summary="Download a file of the workspace as a checkpoint archived it (Range supported)",
)
async def download_checkpoint_file(
    state: StateDep,
    tenant: TenantDep,
    execution_id: TaskPath,
    checkpoint_id: TaskPath,
    path: FilePath,
    request: Request,
) -> Response:
    checked = _checked(path)
    if not checked:
        raise ApiError(400, ErrorCode.INVALID_PATH, "the workspace itself is not a file")
    task_id, archive_id = await _checkpoint_archive(state, tenant, execution_id, checkpoint_id)
    first = await ask_files(
        state, tenant, task_id, "read", path=checked, length=0, archive_id=archive_id
    )
    return _download(state, tenant, task_id, first.entries[0], request, archive_id=archive_id)


# -- downloads -------------------------------------------------------------------------

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single-range ``Range`` header; None for the whole file
    (no header, or one this does not serve: several ranges, another unit). 416 when
    it starts past the end."""
    if header is None:
        return None
    found = _RANGE.match(header.strip())
    if found is None or found.group(1) == found.group(2) == "":
        return None
    start, end = found.group(1), found.group(2)
    if start == "":  # the last N bytes
        if int(end) == 0:
            raise _unsatisfiable(size)
        return max(0, size - int(end)), size - 1
    first = int(start)
    last = min(int(end), size - 1) if end else size - 1
    if first >= size or (end and int(end) < first):
        raise _unsatisfiable(size)
    return first, last


def _unsatisfiable(size: int) -> ApiError:
    return ApiError(
        416,
        ErrorCode.RANGE_NOT_SATISFIABLE,
        f"the range is outside the file's {size} bytes",
        {"size": size},
        headers={"Content-Range": f"bytes */{size}"},
    )


def _download(
    state: GatewayState,
    tenant: str,
    task_id: str,
    entry: WorkspaceFile,
    request: Request,
    *,
    archive_id: str | None,
) -> Response:
    size = entry.size
    asked = _range(request.headers.get("range"), size)
    first, last = asked if asked is not None else (0, size - 1)
    name = entry.path.rsplit("/", 1)[-1]
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Length": str(max(0, last - first + 1)),
        # The agent wrote it: never run as a page of the API's origin.
        "Content-Disposition": f"attachment; filename*=UTF-8''{quote(name)}",
        "Content-Security-Policy": "sandbox",
        "X-Content-Type-Options": "nosniff",
    }
    if entry.sha256:
        headers["ETag"] = f'"{entry.sha256}"'
    if asked is not None:
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"

    async def chunks() -> AsyncIterator[bytes]:
        offset = first
        while offset <= last:
            reply = await ask_files(
                state,
                tenant,
                task_id,
                "read",
                path=entry.path,
                offset=offset,
                length=min(CHUNK_BYTES, last - offset + 1),
                archive_id=archive_id,
                expect_size=None if archive_id else entry.size,
                expect_mtime_ns=None if archive_id else entry.mtime_ns,
            )
            data = base64.b64decode(reply.data or "")
            if not data:
                # Shorter than it was: the length sent cannot be met; cut the response.
                raise RuntimeError(f"{entry.path!r} ended early")
            yield data
            offset += len(data)

    content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return StreamingResponse(
        chunks(), status_code=206 if asked else 200, media_type=content_type, headers=headers
    )
