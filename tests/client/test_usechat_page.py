"""A React page using the AI SDK's ``useChat`` on ``@holdfast/client/ai-sdk``, in Chromium.

The page (``usechat_page/page.jsx``) is bundled with esbuild against
``@ai-sdk/react`` 4, ``ai`` 7, React 19 and the built client (installed from
npm into a temporary directory, the client as a ``file:`` dependency) and
served at the gateway's own origin by Playwright's routing, so its requests go
to the real gateway without CORS. Debian's chromium (Playwright cannot download
its browsers here). A message sent from the page shows the scripted model's
answer; a page reloaded during a turn resumes it (``resume: true``,
``reconnectToStream``) and shows the whole answer.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.client.test_typescript_client import ts_package
from tests.processes import EngineProcesses

__all__ = ["ts_package"]  # the built client, shared with test_typescript_client

pytestmark = pytest.mark.timeout(300)

PAGE = Path(__file__).resolve().parent / "usechat_page"
CHROMIUM = next(
    (
        path
        for path in ("/usr/bin/chromium", shutil.which("chromium"))
        if path and Path(path).exists()
    ),
    None,
)
# The versions the adapter is tested against (its README says the same).
DEPENDENCIES = {
    "@ai-sdk/react": "~4.0.177",
    "ai": "~7.0.173",
    "esbuild": "^0.25.0",
    "react": "~19.2.1",
    "react-dom": "~19.2.1",
}


@pytest.fixture(scope="session")
def page_bundle(ts_package: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The page's JavaScript, bundled."""
    if CHROMIUM is None:
        pytest.skip("no chromium binary (apt-get install chromium)")
    work = tmp_path_factory.mktemp("usechat-page")
    dependencies = {**DEPENDENCIES, "@holdfast/client": f"file:{ts_package}"}
    (work / "package.json").write_text(
        json.dumps({"name": "usechat-page", "private": True, "dependencies": dependencies})
    )
    shutil.copy(PAGE / "page.jsx", work / "page.jsx")
    for command in (
        ["npm", "install", "--no-audit", "--no-fund"],
        [
            "node_modules/.bin/esbuild",
            "page.jsx",
            "--bundle",
            "--format=esm",
            "--jsx=automatic",
            '--define:process.env.NODE_ENV="production"',
            "--outfile=page.js",
            "--log-level=warning",
        ],
    ):
        done = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            if command[0] == "npm" and "ENOTFOUND" in done.stderr + done.stdout:
                pytest.skip(f"npm could not reach the registry: {done.stderr[-300:]}")
            pytest.fail(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return (work / "page.js").read_text()


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox"]
        )
        yield chromium
        await chromium.close()


async def open_page(browser: Any, engine: EngineProcesses, bundle: str, **params: str) -> Any:
    """A page at the gateway's origin (``/usechat/``, served here) with ``params``."""
    page = await browser.new_page()
    html = (
        '<!doctype html><div id="root"></div><script type="module" src="/usechat/page.js"></script>'
    )

    async def serve(route: Any) -> None:
        if route.request.url.split("?")[0].endswith("/page.js"):
            await route.fulfill(body=bundle, content_type="text/javascript")
        else:
            await route.fulfill(body=html, content_type="text/html")

    await page.route(f"{engine.url}/usechat/**", serve)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.errors = errors
    query = "&".join(f"{name}={value}" for name, value in params.items())
    await page.goto(f"{engine.url}/usechat/index.html?{query}")
    return page


def script(**spec: Any) -> str:
    return "/script " + json.dumps(spec)


async def test_a_message_sent_from_the_page_shows_the_answer(
    browser: Any, engine: EngineProcesses, api_keys: dict[str, str], page_bundle: str
) -> None:
    task = f"usechat-{secrets.token_hex(4)}"
    page = await open_page(
        browser, engine, page_bundle, task=task, key=api_keys["main"], send="hello%20page"
    )
    answer = page.locator(".message.assistant")
    await answer.filter(has_text="You said: hello page").wait_for(timeout=60_000)
    await page.locator("#status", has_text="ready").wait_for(timeout=30_000)
    assert await page.locator(".message.user").inner_text() == "hello page"
    assert page.errors == []


async def test_a_reloaded_page_resumes_the_running_turn(
    browser: Any, engine: EngineProcesses, api_keys: dict[str, str], page_bundle: str
) -> None:
    task = f"usechat-{secrets.token_hex(4)}"
    words = " ".join(f"w{i}" for i in range(40))
    message = script(text=words, delay_ms=100)
    page = await open_page(
        browser, engine, page_bundle, task=task, key=api_keys["main"], send=_quote(message)
    )
    answer = page.locator(".message.assistant")
    await answer.filter(has_text="w3").wait_for(timeout=60_000)
    assert "w39" not in await answer.inner_text(), "the turn ended before the reload"
    # The same chat, reloaded: nothing sent; useChat({ resume: true }) reconnects.
    await page.goto(f"{engine.url}/usechat/index.html?task={task}&key={api_keys['main']}")
    await answer.filter(has_text="w39").wait_for(timeout=60_000)
    assert (await answer.inner_text()).split() == words.split()
    assert page.errors == []


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")
