"""Every non-streaming operation, as a request and how to read its answer.

Each function has the signature of the client method of its name: both
clients send what it returns (one blocking, one with asyncio), so a route's
path, parameters and answer are written once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict

T = TypeVar("T")
JsonObject = dict[str, Any]


class PendingRequest(BaseModel):
    """A permission prompt, question or unknown tool outcome waiting for an answer
    (``GET /hitl/pending``)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    request_id: str
    task_id: str
    turn_id: str
    kind: Literal["permission", "question", "outcome_unknown"]
    question: str
    tool_call: dict[str, Any] | None = None
    created_at: int
    expires_at: int


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    read: Callable[[httpx.Response], T]
    params: dict[str, str] = field(default_factory=dict)
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _segment(value: str) -> str:
    return quote(value, safe="")


def _object(response: httpx.Response) -> JsonObject:
    if not response.content:
        return {}
    body = response.json()
    return body if isinstance(body, dict) else {"value": body}


def _nothing(_: httpx.Response) -> None:
    return None


def _bytes(response: httpx.Response) -> bytes:
    return response.content


def _params(**values: str | int | None) -> dict[str, str]:
    return {k: str(v) for k, v in values.items() if v is not None}


def _obj(method: str, path: str, **kw: Any) -> Call[JsonObject]:
    return Call(method, path, _object, **kw)


# -- turns and HITL ---------------------------------------------------------------------


def execute_body(message: str | None, options: Mapping[str, Any]) -> JsonObject:
    """``POST /execute``'s body: the message and the options given (None: left out)."""
    body: JsonObject = {} if message is None else {"message": message}
    for name, value in options.items():
        if value is not None:
            if name == "media":
                value = list(value)
            elif name in ("output_schema", "webhook"):
                value = dict(value)
            body[name] = value
    return body


def cancel(task_id: str) -> Call[JsonObject]:
    return _obj("POST", "/execute/cancel", json={"task_id": task_id})


def _pending(response: httpx.Response) -> list[PendingRequest]:
    return [PendingRequest.model_validate(item) for item in response.json()["pending"]]


def pending(task_id: str | None = None) -> Call[list[PendingRequest]]:
    """Permission prompts and questions waiting for an answer (of one task, or all)."""
    return Call("GET", "/hitl/pending", _pending, params=_params(task_id=task_id))


def answer(
    task_id: str,
    answer: str,
    *,
    request_id: str | None = None,
    feedback: str | None = None,
    content_blocks: list[Mapping[str, Any]] | None = None,
) -> Call[JsonObject]:
    """Answer a pending request (``yes``/``no`` for a permission prompt)."""
    body: JsonObject = {"task_id": task_id, "answer": answer}
    if request_id is not None:
        body["request_id"] = request_id
    if feedback is not None:
        body["feedback"] = feedback
    if content_blocks:
        body["content_blocks"] = list(content_blocks)
    return _obj("POST", "/hitl/respond", json=body)


# -- tasks --------------------------------------------------------------------------------


def list_tasks(**params: str | int | None) -> Call[JsonObject]:
    return _obj("GET", "/tasks", params=_params(**params))


def get_task(task_id: str) -> Call[JsonObject]:
    return _obj("GET", f"/tasks/{_segment(task_id)}")


def task_messages(task_id: str, **params: str | int | None) -> Call[JsonObject]:
    return _obj("GET", f"/tasks/{_segment(task_id)}/messages", params=_params(**params))


def delete_task(task_id: str) -> Call[JsonObject]:
    return _obj("DELETE", f"/tasks/{_segment(task_id)}")


def _working_memory(response: httpx.Response) -> dict[str, str]:
    return dict(response.json()["working_memory"])


def working_memory(task_id: str) -> Call[dict[str, str]]:
    return Call("GET", f"/tasks/{_segment(task_id)}/working-memory", _working_memory)


# -- a task's files (its workspace), and a checkpoint's ----------------------------------


def _file_path(path: str) -> str:
    return quote(path.strip("/"), safe="/")


def _range(start: int | None, end: int | None) -> dict[str, str]:
    if start is None and end is None:
        return {}
    return {"Range": f"bytes={'' if start is None else start}-{'' if end is None else end}"}


def list_files(task_id: str, path: str = "", *, recursive: bool = False) -> Call[JsonObject]:
    """The entries of a directory of the task's workspace (``files``: path, kind,
    size, sha256, modified, download), all below it with ``recursive``."""
    params = _params(path=path or None, recursive="true" if recursive else None)
    return _obj("GET", f"/tasks/{_segment(task_id)}/files", params=params)


def download_file(
    task_id: str, path: str, *, start: int | None = None, end: int | None = None
) -> Call[bytes]:
    """The file's bytes; ``start``/``end`` (inclusive; ``end`` alone: the last
    ``end`` bytes) ask for a range of them."""
    return Call(
        "GET",
        f"/tasks/{_segment(task_id)}/files/{_file_path(path)}",
        _bytes,
        headers=_range(start, end),
    )


def upload_file(task_id: str, path: str, content: bytes) -> Call[JsonObject]:
    """Write ``content`` as the file (its directories made); between turns, or
    under ``inputs/`` while one runs. The file's entry."""
    return _obj(
        "PUT",
        f"/tasks/{_segment(task_id)}/files/{_file_path(path)}",
        content=content,
        headers={"Content-Type": "application/octet-stream"},
    )


def delete_file(task_id: str, path: str) -> Call[None]:
    """Remove a file, a symlink or a directory with all it holds."""
    return Call("DELETE", f"/tasks/{_segment(task_id)}/files/{_file_path(path)}", _nothing)


def _checkpoint_files(execution_id: str, checkpoint_id: str) -> str:
    return f"/v1/execution/{_segment(execution_id)}/checkpoints/{_segment(checkpoint_id)}/files"


def list_checkpoint_files(
    execution_id: str, checkpoint_id: str, path: str = "", *, recursive: bool = False
) -> Call[JsonObject]:
    """:meth:`list_files` of the workspace as the checkpoint archived it."""
    params = _params(path=path or None, recursive="true" if recursive else None)
    return _obj("GET", _checkpoint_files(execution_id, checkpoint_id), params=params)


def download_checkpoint_file(
    execution_id: str,
    checkpoint_id: str,
    path: str,
    *,
    start: int | None = None,
    end: int | None = None,
) -> Call[bytes]:
    """:meth:`download_file` of the workspace as the checkpoint archived it."""
    return Call(
        "GET",
        f"{_checkpoint_files(execution_id, checkpoint_id)}/{_file_path(path)}",
        _bytes,
        headers=_range(start, end),
    )


# -- agents, skills, assets ---------------------------------------------------------------


def list_agents() -> Call[JsonObject]:
    return _obj("GET", "/agents")


def get_agent(name: str) -> Call[JsonObject]:
    return _obj("GET", f"/agents/{_segment(name)}")


def create_agent(spec: Mapping[str, Any]) -> Call[JsonObject]:
    return _obj("POST", "/agents", json=dict(spec))


def replace_agent(name: str, spec: Mapping[str, Any]) -> Call[JsonObject]:
    return _obj("PUT", f"/agents/{_segment(name)}", json=dict(spec))


def delete_agent(name: str) -> Call[None]:
    return Call("DELETE", f"/agents/{_segment(name)}", _nothing)


def list_skills() -> Call[JsonObject]:
    return _obj("GET", "/skills")


def get_skill(name: str) -> Call[JsonObject]:
    return _obj("GET", f"/skills/{_segment(name)}")


def create_skill(skill: Mapping[str, Any] | bytes) -> Call[JsonObject]:
    """A skill as JSON, or as the bytes of a zip archive."""
    if isinstance(skill, bytes):
        return _obj("POST", "/skills", content=skill, headers={"Content-Type": "application/zip"})
    return _obj("POST", "/skills", json=dict(skill))


def delete_skill(name: str) -> Call[None]:
    return Call("DELETE", f"/skills/{_segment(name)}", _nothing)


def list_servers() -> Call[JsonObject]:
    return _obj("GET", "/assets/servers")


def get_server(name: str) -> Call[JsonObject]:
    return _obj("GET", f"/assets/servers/{_segment(name)}")


def server_tools(name: str) -> Call[JsonObject]:
    return _obj("GET", f"/assets/servers/{_segment(name)}/tools")


def register_server(spec: Mapping[str, Any]) -> Call[JsonObject]:
    return _obj("POST", "/assets/servers", json=dict(spec))


def delete_server(name: str) -> Call[None]:
    return Call("DELETE", f"/assets/servers/{_segment(name)}", _nothing)


def connect_server(name: str) -> Call[JsonObject]:
    return _obj("GET", f"/assets/servers/{_segment(name)}/connect")


# -- memory ---------------------------------------------------------------------------------

MemoryKind = Literal["knowledge", "episodes", "social"]


def search_memory(
    kind: MemoryKind, query: str, *, limit: int | None = None, user_id: str | None = None
) -> Call[JsonObject]:
    return _obj(
        "GET",
        f"/memory/{_segment(kind)}/search",
        params=_params(q=query, limit=limit, user_id=user_id),
    )


def save_fact(text: str, *, user_id: str | None = None, **extra: Any) -> Call[JsonObject]:
    body: JsonObject = {"text": text, **extra}
    if user_id is not None:
        body["user_id"] = user_id
    return _obj("POST", "/memory/knowledge", json=body)


def get_fact(fact_id: str, *, user_id: str | None = None) -> Call[JsonObject]:
    return _obj("GET", f"/memory/knowledge/{_segment(fact_id)}", params=_params(user_id=user_id))


def delete_fact(fact_id: str, *, user_id: str | None = None) -> Call[None]:
    return Call(
        "DELETE",
        f"/memory/knowledge/{_segment(fact_id)}",
        _nothing,
        params=_params(user_id=user_id),
    )


def get_soul(*, user_id: str | None = None) -> Call[JsonObject]:
    return _obj("GET", "/memory/soul", params=_params(user_id=user_id))


def put_soul(content: str, *, user_id: str | None = None) -> Call[JsonObject]:
    body: JsonObject = {"content": content}
    if user_id is not None:
        body["user_id"] = user_id
    return _obj("PUT", "/memory/soul", json=body)


def soul_versions(*, user_id: str | None = None) -> Call[JsonObject]:
    return _obj("GET", "/memory/soul/versions", params=_params(user_id=user_id))


def export_memory(*, user_id: str | None = None) -> Call[bytes]:
    return Call("GET", "/memory/export", _bytes, params=_params(user_id=user_id))


def import_memory(ndjson: bytes, *, user_id: str | None = None) -> Call[JsonObject]:
    return _obj(
        "POST",
        "/memory/import",
        params=_params(user_id=user_id),
        content=ndjson,
        headers={"Content-Type": "application/x-ndjson"},
    )


def forget_memory(*, user_id: str | None = None) -> Call[JsonObject]:
    return _obj("DELETE", "/memory", params=_params(user_id=user_id))


def learning_status() -> Call[JsonObject]:
    return _obj("GET", "/learning/status")


def health() -> Call[JsonObject]:
    return _obj("GET", "/health")


# -- executions (/v1/execution) --------------------------------------------------------------


def create_execution(spec: Mapping[str, Any]) -> Call[JsonObject]:
    return _obj("POST", "/v1/execution", json=dict(spec))


def get_execution(execution_id: str) -> Call[JsonObject]:
    return _obj("GET", f"/v1/execution/{_segment(execution_id)}")


def list_executions(**params: str | int | None) -> Call[JsonObject]:
    return _obj("GET", "/v1/execution", params=_params(**params))


def checkpoint_execution(
    execution_id: str, state: Mapping[str, Any] | None = None, *, label: str | None = None
) -> Call[JsonObject]:
    body: JsonObject = {}
    if state is not None:
        body["state"] = dict(state)
    if label is not None:
        body["label"] = label
    return _obj("PUT", f"/v1/execution/{_segment(execution_id)}/checkpoint", json=body)


def pause_execution(execution_id: str) -> Call[JsonObject]:
    return _obj("POST", f"/v1/execution/{_segment(execution_id)}/pause")


def resume_execution(execution_id: str, *, checkpoint_id: str | None = None) -> Call[JsonObject]:
    body = {"checkpoint_id": checkpoint_id} if checkpoint_id is not None else {}
    return _obj("POST", f"/v1/execution/{_segment(execution_id)}/resume", json=body)


def delete_execution(execution_id: str) -> Call[JsonObject]:
    return _obj("DELETE", f"/v1/execution/{_segment(execution_id)}")
