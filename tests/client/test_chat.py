"""``holdfast chat`` under tmux: typed into with send-keys, read with capture-pane."""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from holdfast_client import Client, HitlRequest

from tests.client.proxy import CuttingProxy
from tests.isolation import fresh_tenant_keys  # noqa: F401
from tests.processes import EngineProcesses

# Generous: the session engine may be started by these tests on a loaded machine.
pytestmark = pytest.mark.timeout(180)


class Terminal:
    """A detached tmux session on a server of its own running one command."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.socket = f"holdfast-chat-{secrets.token_hex(4)}"
        assignments = [f"{k}={v}" for k, v in env.items()]
        shell = shlex.join(["env", *assignments, *command])
        # Keep the pane after the command exits, to read its last words.
        self._tmux("new-session", "-d", "-s", "chat", "-x", "160", "-y", "60", shell)
        self._tmux("set-option", "-t", "chat", "remain-on-exit", "on")

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def type(self, text: str) -> None:
        self._tmux("send-keys", "-t", "chat", "-l", text)
        self._tmux("send-keys", "-t", "chat", "Enter")

    def screen(self) -> str:
        # -J joins wrapped lines; -S - from the start of the history.
        return self._tmux("capture-pane", "-t", "chat", "-p", "-J", "-S", "-")

    def wait_for(self, check: Callable[[str], bool], timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if check(screen):
                return screen
            assert time.monotonic() < deadline, f"timed out; the screen:\n{screen}"
            time.sleep(0.1)

    def exited(self) -> bool:
        return self._tmux("display-message", "-p", "-t", "chat", "#{pane_dead}").strip() == "1"

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def terminal(tmp_path: Path, tenant_keys: dict[str, str]) -> Iterator[Callable[..., Terminal]]:
    """A chat as a tenant of the test's own: what it types is learned into no brain
    another test searches."""
    opened: list[Terminal] = []

    def open_chat(url: str, *args: str) -> Terminal:
        env = {"HOLDFAST_API_KEY": tenant_keys["main"], "HOME": str(tmp_path), "TERM": "xterm"}
        term = Terminal([sys.executable, "-m", "holdfast", "chat", "--url", url, *args], env)
        opened.append(term)
        return term

    yield open_chat
    for term in opened:
        term.close()


def script(**kw: object) -> str:
    return "/script " + json.dumps(kw)


def test_chat_streams_asks_permission_and_continues_a_task(
    engine: EngineProcesses, terminal: Callable[..., Terminal]
) -> None:
    term = terminal(engine.url)
    # The header names the model before anything is sent (the loop-workers' default,
    # from GET /health), with what the scripted one does; the first reply agrees.
    screen = term.wait_for(lambda s: "you>" in s)
    assert "model: scripted:scripted — the built-in scripted model" in screen, screen
    term.type("hello from tmux")
    screen = term.wait_for(lambda s: "You said: hello from tmux" in s and s.count("you>") == 2)
    assert screen.count("model: scripted:scripted") == 1, screen
    term.type("/model")
    term.wait_for(lambda s: "/model\nscripted:scripted\n" in s and s.count("you>") == 3)

    calls = [{"name": "bash", "input": {"command": "echo chat-ran-it"}}]
    term.type(script(text="", tool_calls=calls, thinking="pondering deeply"))
    screen = term.wait_for(lambda s: "allow? [y/N]" in s)
    assert "pondering deeply" in screen
    assert "⚙ bash" in screen and "echo chat-ran-it" in screen
    term.type("y")
    screen = term.wait_for(lambda s: "chat-ran-it\\n" in s and s.count("you>") == 4)
    assert "answered: yes" in screen
    # Named once: the model did not change.
    assert screen.count("model: scripted:scripted") == 1, screen

    term.type("/task")
    task_id = term.wait_for(lambda s: s.count("you>") == 5).split("/task\n")[1].split("\n")[0]
    term.type("/exit")
    term.wait_for(lambda _: term.exited())

    again = terminal(engine.url, "--task", task_id)
    again.wait_for(lambda s: "you>" in s)
    again.type("and now?")
    again.wait_for(lambda s: "You said: and now? Earlier you said: /script" in s)


def test_chat_names_the_agents_model_in_its_header(
    engine: EngineProcesses, tenant_keys: dict[str, str], terminal: Callable[..., Terminal]
) -> None:
    # An agent's preferred model, served by a loop-worker (the scripted provider),
    # is the one its turns run on: the header says so before anything is sent.
    name = f"picky-{secrets.token_hex(3)}"
    with Client(engine.url, tenant_keys["main"]) as client:
        client.create_agent(
            {
                "name": name,
                "description": "answers with its own model",
                "system_prompt": "Answer briefly.",
                "model": "scripted:picked-by-the-agent",
            }
        )
    term = terminal(engine.url, "--agent", name)
    screen = term.wait_for(lambda s: "you>" in s)
    assert "model: scripted:picked-by-the-agent" in screen, screen
    term.type("hello")
    screen = term.wait_for(lambda s: "You said: hello" in s and s.count("you>") == 2)
    # The reply ran on it: no second model line.
    assert screen.count("model: scripted:") == 1, screen


def test_chat_rides_out_dropped_connections(
    engine: EngineProcesses, terminal: Callable[..., Terminal]
) -> None:
    port = urlsplit(engine.url).port
    assert port is not None
    with CuttingProxy(port, cuts=15, seed=5) as proxy:
        term = terminal(proxy.url)
        term.wait_for(lambda s: "you>" in s)
        term.type(script(text="z", deltas=300, delay_ms=3))
        screen = term.wait_for(lambda s: s.count("you>") == 2)
    assert proxy.cuts_made >= 5
    # Every delta once: the text is whole, nothing doubled by a reconnect.
    assert "z" * 300 in screen and "z" * 301 not in screen
    assert "error" not in screen


def test_chat_on_a_task_waiting_for_an_answer_asks_it(
    engine: EngineProcesses, tenant_keys: dict[str, str], terminal: Callable[..., Terminal]
) -> None:
    calls = [{"name": "bash", "input": {"command": "echo answered-later"}}]
    with Client(engine.url, tenant_keys["main"]) as client:
        with client.stream(script(text="", tool_calls=calls)) as turn:
            asked = next(e for e in turn if isinstance(e, HitlRequest))
        # The app that asked is gone; the turn waits, parked, for an answer.
        assert turn.task_id is not None
        assert [p.request_id for p in client.pending(turn.task_id)] == [asked.request_id]
    term = terminal(engine.url, "--task", turn.task_id)
    term.wait_for(lambda s: "this task waits for an answer" in s and "allow? [y/N]" in s)
    term.type("y")
    screen = term.wait_for(lambda s: "answered-later\\n" in s and "you>" in s)
    assert "⚙ bash" in screen and "answered: yes" in screen
