"""The web console (``/console``) in a real browser: Playwright driving Debian's
headless Chromium against the session's engine.

The browser reaches the gateway through a TCP proxy of this module, which can
cut every open connection at once: that is how "a dropped connection resumed
with no gap" is tested — the page's EventSource reconnects by itself with
Last-Event-ID and its stream token, and the page must end up with every seq
of the task exactly once, the same list the API replays.

Skipped, saying why, only when no Chromium binary is installed
(``apt-get install chromium``; Playwright's own browser downloads are not
used). Set ``HOLDFAST_CONSOLE_SCREENSHOT=docs/console.png`` to refresh the
README's screenshot while the permission test runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from holdfast.testing import time_scale
from tests.processes import EngineProcesses
from tests.sse_client import execute, replay

CHROMIUM = next(
    (
        path
        for path in ("/usr/bin/chromium", shutil.which("chromium"))
        if path and Path(path).exists()
    ),
    None,
)
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)"),
]
SCREENSHOT = os.environ.get("HOLDFAST_CONSOLE_SCREENSHOT")


class CuttingProxy:
    """Forwards TCP connections to the gateway; :meth:`cut` drops all open ones."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        assert parts.hostname is not None and parts.port is not None
        self.host, self.port = parts.hostname, parts.port
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()
        self.cuts = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        self._open |= {writer, up_writer}
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while chunk := await source.read(65536):
                sink.write(chunk)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._open.discard(sink)
            sink.close()

    def cut(self) -> None:
        """Abort every open connection, both sides, as a network failure would."""
        self.cuts += 1
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for pipe in list(self._pipes):
            pipe.cancel()


@pytest.fixture(scope="module")
async def proxy(engine: EngineProcesses) -> AsyncIterator[tuple[CuttingProxy, str]]:
    cutting = CuttingProxy(engine.url)
    url = await cutting.start()
    yield cutting, url
    await cutting.close()


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        await chromium.close()


@pytest.fixture
async def page(
    browser: Any, proxy: tuple[CuttingProxy, str], api_keys: dict[str, str]
) -> AsyncIterator[Any]:
    """A signed-in console in a fresh browser context (its own sessionStorage)."""
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    tab = await context.new_page()
    problems: list[str] = []
    tab.on("pageerror", lambda error: problems.append(str(error)))
    tab.on(
        "console",
        lambda message: (
            problems.append(message.text) if "Content Security" in message.text else None
        ),
    )
    await tab.goto(f"{proxy[1]}/console")
    await tab.fill("#key-input", api_keys["main"])
    await tab.click("#sign-in-form button")
    await tab.wait_for_selector("#app", state="visible")
    yield tab
    await context.close()
    assert not problems, problems  # no script error and no CSP violation


async def send(page: Any, message: str) -> None:
    await page.fill("#message-input", message)
    await page.click("#send-form button")


async def wait_status(page: Any, status: str, within_ms: float = 60_000) -> None:
    await page.wait_for_function(
        "s => document.getElementById('task-status').textContent === s",
        arg=status,
        timeout=within_ms,
    )


async def server_seqs(base: str, key: str, task_id: str) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        got = await replay(client, base, key, {"task_id": task_id})
    assert got.status == 200
    return got.seqs


def script(**fields: Any) -> str:
    return "/script " + json.dumps(fields)


async def test_the_console_is_served_with_a_content_security_policy(
    engine: EngineProcesses,
) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=10) as client:
        page = await client.get("/console")
        script_file = await client.get("/console/console.js")
        missing = await client.get("/console/secrets.txt")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy
    assert "unsafe-inline" not in policy
    assert script_file.status_code == 200 and "EventSource" in script_file.text
    assert script_file.headers["content-security-policy"] == policy
    assert missing.status_code == 404 and missing.json()["error"] == "NOT_FOUND"


async def test_a_turn_streams_into_the_page_as_text(
    page: Any, engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    marker = secrets.token_hex(3)
    hostile = f'<img src=x id="injected-{marker}"> and <b>bold</b> {marker}'
    await send(page, script(text=f"Hello from the console {hostile}", delay_ms=20))
    await wait_status(page, "idle")
    transcript = page.locator("#transcript")
    text = await transcript.inner_text()
    # Model output is shown as text: the markup is visible, not rendered.
    assert f"Hello from the console {hostile}" in text
    assert await page.locator(f"#injected-{marker}").count() == 0
    assert await transcript.locator("b").count() == 0
    task_id = await page.evaluate("hfConsole.taskId")
    seqs = await page.evaluate("hfConsole.seqs")
    assert seqs == await server_seqs(engine.url, api_keys["main"], task_id)
    assert await page.locator(f"#task-list li[data-task='{task_id}']").count() == 1
    # A second message goes to the same task, in the same view.
    await send(page, script(text="second answer"))
    await page.wait_for_function("() => document.body.innerText.includes('second answer')")
    await wait_status(page, "idle")
    assert await page.evaluate("hfConsole.taskId") == task_id


async def test_an_existing_task_opens_with_its_history_then_follows_turns_started_elsewhere(
    page: Any, engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"console-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        first = await execute(
            client, engine.url, key, {"message": script(text="stored answer"), "task_id": task_id}
        )
        assert first.events[-1]["phase"] == "completed"
        await page.fill("#open-input", task_id)
        await page.click("#open-form button")
        await page.wait_for_function("() => document.body.innerText.includes('stored answer')")
        assert await page.evaluate("hfConsole.seqs") == first.seqs
        # A turn another client starts: the page's EventSource picks it up by itself.
        second = await execute(
            client, engine.url, key, {"message": script(text="from elsewhere"), "task_id": task_id}
        )
    await page.wait_for_function(
        "last => hfConsole.lastSeq >= last", arg=second.seqs[-1], timeout=30_000
    )
    assert await page.evaluate("hfConsole.seqs") == first.seqs + second.seqs
    assert "from elsewhere" in await page.locator("#transcript").inner_text()


async def test_a_dropped_connection_resumes_with_no_gap_and_no_repeat(
    page: Any, engine: EngineProcesses, api_keys: dict[str, str], proxy: tuple[CuttingProxy, str]
) -> None:
    cutting, _ = proxy
    words = " ".join(f"w{i:03d}" for i in range(120))
    await send(page, script(text=words, delay_ms=40))  # about five seconds of deltas
    await page.wait_for_function("() => hfConsole.seqs.length > 10")
    for _ in range(2):
        # Cut once the page shows more (after the first cut: it resumed), while
        # the turn still streams.
        shown = await page.evaluate("hfConsole.seqs.length")
        await page.wait_for_function(
            "n => hfConsole.seqs.length > n", arg=shown + 5, timeout=30_000 * time_scale()
        )
        status = await page.evaluate("document.getElementById('task-status').textContent")
        assert status != "idle", "the turn ended before the cut"
        cutting.cut()
    await wait_status(page, "idle")
    task_id = await page.evaluate("hfConsole.taskId")
    seqs = await page.evaluate("hfConsole.seqs")
    expected = await server_seqs(engine.url, api_keys["main"], task_id)
    assert seqs == expected  # every seq, once, in order
    assert len(set(seqs)) == len(seqs)
    assert words in await page.locator("#transcript").inner_text()
    assert cutting.cuts == 2


async def test_a_permission_prompt_is_answered_from_the_page(page: Any) -> None:
    call = {"name": "write_file", "input": {"path": "from-console.txt", "content": "hi"}}
    await send(page, script(text="Let me write that file.", tool_calls=[call]))
    prompt = page.locator("#hitl .prompt")
    await prompt.wait_for(state="visible", timeout=60_000)
    await wait_status(page, "waiting")
    assert "write_file" in await prompt.inner_text()
    if SCREENSHOT:
        await page.screenshot(path=SCREENSHOT)
    await prompt.locator("button.allow").click()
    await wait_status(page, "idle")
    assert await page.locator("#hitl .prompt").count() == 0
    tool = page.locator("#transcript details.tool").first
    summary = await tool.locator("summary").inner_text()
    assert summary.startswith("write_file(") and "from-console.txt" in summary
    assert await tool.locator(".ok").count() == 1  # the result arrived, without error
    assert "answered: yes" in await page.locator("#transcript").inner_text()


async def test_the_other_tabs_show_agents_and_memory(page: Any) -> None:
    await page.click("#tabs button[data-tab=agents]")
    await page.wait_for_selector("#agents-table tbody tr")
    names = await page.locator("#agents-table tbody tr td:first-child").all_inner_texts()
    assert "general" in names
    await page.click("#tabs button[data-tab=memory]")
    await page.wait_for_function("() => document.getElementById('soul').textContent !== ''")
    await page.click("#tabs button[data-tab=executions]")
    await page.wait_for_function(
        "() => document.getElementById('executions-note').textContent !== ''"
        " || document.querySelector('#executions-table tbody tr') !== null"
    )


async def task_status(base: str, key: str, task_id: str) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        got = await client.get(f"{base}/tasks/{task_id}", headers={"X-Engine-Key": key})
    assert got.status_code == 200, got.text
    status: str = got.json()["status"]
    return status


async def test_an_idle_task_holds_one_live_connection_and_follows_the_next_turn(
    page: Any, engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    """An open task with no turn running shows "live" and "idle" and keeps the one
    EventSource it opened: it once ended at once, and the page reopened
    ``/execute/replay`` every few seconds, reading "reconnecting…"."""
    key = api_keys["main"]
    task_id = f"console-idle-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        first = await execute(
            client, engine.url, key, {"message": script(text="idle now"), "task_id": task_id}
        )
        assert first.events[-1]["phase"] == "completed"
        replays: list[str] = []
        page.on(
            "request",
            lambda request: (
                replays.append(request.url) if "/execute/replay" in request.url else None
            ),
        )
        await page.fill("#open-input", task_id)
        await page.click("#open-form button")
        await page.wait_for_function("() => document.body.innerText.includes('idle now')")
        await page.wait_for_function(
            "() => hfConsole.connected"
            " && document.getElementById('stream-status').textContent === 'live'"
        )
        opened = len(replays)
        assert opened == 2, replays  # the history fetch and the one EventSource
        # A bounded window of samples: the stream of an idle task used to end
        # at once and be reopened about every 3 s (Chromium's retry delay).
        samples: list[list[str]] = []
        for _ in range(16):
            samples.append(
                await page.evaluate(
                    "() => [document.getElementById('stream-status').textContent,"
                    " document.getElementById('task-status').textContent]"
                )
            )
            await asyncio.sleep(0.5)
        assert samples == [["live", "idle"]] * len(samples), samples
        assert len(replays) == opened, replays[opened:]
        # The same connection carries a turn another client starts.
        second = await execute(
            client, engine.url, key, {"message": script(text="woken up"), "task_id": task_id}
        )
    await page.wait_for_function(
        "last => hfConsole.lastSeq >= last", arg=second.seqs[-1], timeout=30_000
    )
    assert await page.evaluate("hfConsole.seqs") == first.seqs + second.seqs
    await wait_status(page, "idle")
    assert len(replays) == opened, replays[opened:]


async def user_lines(page: Any) -> list[str]:
    texts: list[str] = await page.locator("#transcript .user").all_inner_texts()
    return texts


async def test_the_users_own_messages_are_shown_in_their_turns(
    page: Any, engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"console-user-{secrets.token_hex(3)}"
    mine = [f"first question {secrets.token_hex(2)}", f"second question {secrets.token_hex(2)}"]
    async with httpx.AsyncClient(timeout=60) as client:
        for message in mine:
            done = await execute(client, engine.url, key, {"message": message, "task_id": task_id})
            assert done.events[-1]["phase"] == "completed"
        # History: each stored turn shows the message that started it, in its turn.
        await page.fill("#open-input", task_id)
        await page.click("#open-form button")
        await page.wait_for_function(
            "n => document.querySelectorAll('#transcript .user').length >= n", arg=2
        )
        assert await user_lines(page) == mine
        turns = page.locator("#transcript li.turn")
        assert await turns.count() == 2
        for index, message in enumerate(mine):
            assert await turns.nth(index).locator(".user").inner_text() == message
        # A turn another client starts while the task is open.
        elsewhere = f"from another client {secrets.token_hex(2)}"
        await execute(client, engine.url, key, {"message": elsewhere, "task_id": task_id})
    await page.wait_for_function(
        "n => document.querySelectorAll('#transcript .user').length >= n", arg=3
    )
    # And one typed here.
    typed = f"typed in the console {secrets.token_hex(2)}"
    await send(page, typed)
    await page.wait_for_function(
        "n => document.querySelectorAll('#transcript .user').length >= n", arg=4
    )
    await wait_status(page, "idle")
    assert await user_lines(page) == [*mine, elsewhere, typed]


async def test_the_task_list_and_the_open_task_use_one_status_vocabulary(
    page: Any, engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]

    async def agree(status: str) -> None:
        await wait_status(page, status)
        task_id = await page.evaluate("hfConsole.taskId")
        row = page.locator(f"#task-list li[data-task='{task_id}'] .badge")
        await page.wait_for_function(
            "([id, s]) => document.querySelector(`#task-list li[data-task='${id}'] .badge`)"
            "?.textContent === s",
            arg=[task_id, status],
        )
        assert await row.inner_text() == status
        assert await task_status(engine.url, key, task_id) == status

    call = {"name": "write_file", "input": {"path": "vocabulary.txt", "content": "hi"}}
    await send(page, script(text="asking first", tool_calls=[call]))
    await page.locator("#hitl .prompt").wait_for(state="visible", timeout=60_000)
    await agree("waiting")
    await page.locator("#hitl .prompt button.deny").click()
    await agree("idle")
    assert "turn completed" in await page.locator("#transcript").inner_text()
    # Reopened from the list, an idle task reads the same word.
    task_id = await page.evaluate("hfConsole.taskId")
    await page.click("#new-task")
    await page.click(f"#task-list li[data-task='{task_id}']")
    await agree("idle")


async def test_the_sign_in_hint_names_both_ways_to_a_key_and_a_favicon_is_served(
    engine: EngineProcesses,
) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=10) as client:
        page = await client.get("/console")
        icon = await client.get("/favicon.ico")
    assert "holdfast keys create" in page.text
    assert "~/.holdfast/api-key" in page.text
    assert icon.status_code == 200, icon.text
    assert icon.headers["content-type"].startswith("image/")
    assert len(icon.content) > 0
