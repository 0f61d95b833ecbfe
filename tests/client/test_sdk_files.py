"""The Python SDK's file calls (a task's files, a checkpoint's) against the session engine."""

from __future__ import annotations

import hashlib
import secrets

import pytest
from holdfast_client import AsyncClient, Client, HoldfastError

from tests.processes import EngineProcesses

pytestmark = pytest.mark.timeout(180)


def test_upload_list_download_delete(engine: EngineProcesses, api_keys: dict[str, str]) -> None:
    task = f"sdk-files-{secrets.token_hex(4)}"
    data = secrets.token_bytes(1_500_000)
    with Client(engine.url, api_keys["main"]) as client:
        client.stream("hello", task_id=task).until_done()
        assert client.list_files(task)["files"] == []
        entry = client.upload_file(task, "inputs/data bin/blob.bin", data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["size"] == len(data)
        client.upload_file(task, "notes.md", b"# notes\n")
        top = client.list_files(task)["files"]
        assert [(f["path"], f["kind"]) for f in top] == [("inputs", "dir"), ("notes.md", "file")]
        deep = client.list_files(task, "inputs", recursive=True)["files"]
        assert [f["path"] for f in deep] == ["inputs/data bin", "inputs/data bin/blob.bin"]
        assert client.download_file(task, "inputs/data bin/blob.bin") == data
        assert (
            client.download_file(task, "inputs/data bin/blob.bin", start=10, end=19) == data[10:20]
        )
        assert client.download_file(task, "inputs/data bin/blob.bin", end=7) == data[-7:]
        client.delete_file(task, "inputs")
        assert [f["path"] for f in client.list_files(task)["files"]] == ["notes.md"]
        with pytest.raises(HoldfastError) as missing:
            client.download_file(task, "inputs/data bin/blob.bin")
        assert missing.value.status == 404 and missing.value.code == "FILE_NOT_FOUND"
        with pytest.raises(HoldfastError) as climbing:
            client.list_files(task, "../..")
        assert climbing.value.status == 422 and climbing.value.code == "INVALID_REQUEST"


async def test_async_client_files(engine: EngineProcesses, api_keys: dict[str, str]) -> None:
    task = f"sdk-files-{secrets.token_hex(4)}"
    async with AsyncClient(engine.url, api_keys["main"]) as client:
        await client.stream("hello", task_id=task).until_done()
        await client.upload_file(task, "a.txt", b"async")
        assert await client.download_file(task, "a.txt") == b"async"
        listed = await client.list_files(task)
        assert listed["files"][0]["download"] == f"/tasks/{task}/files/a.txt"
        await client.delete_file(task, "a.txt")
        assert (await client.list_files(task))["files"] == []
