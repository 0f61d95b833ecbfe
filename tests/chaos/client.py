"""Chaos clients: one turn at a time per task, hanging up and reconnecting at random.

A client keeps every logged event it receives as the raw ``data:`` string,
keyed by seq, so the end of the run can compare what it saw, byte for byte,
with the final log. Each connection is checked on the spot: its events must
be exactly ``cursor+1, cursor+2, ...`` (no gap, no duplicate), and a seq seen
again must carry the same JSON.

Starting a turn when the POST fails (the gateway died, a 503 while Redis
restarts, a dropped connection): the request may or may not have been
accepted. The client never re-sends blindly. It reads the task's log after
the previous turn's terminal event (``GET /execute/replay``, bounded in
time); this client is the only writer of its task and sends one message per
turn, so a ``started`` event there with a turn id it does not know is this
message's turn, and the client follows it. Only when there is none does it
POST again, with the message's ``Idempotency-Key``: should the first POST
land after all (its gateway stalled), the engine starts one turn for both.
(A turn row whose ``started`` was never logged is caught by the end-of-run
checks against PostgreSQL.)
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import SSEError, aconnect_sse

from tests.chaos.cluster import ChaosCluster

TERMINAL_PHASES = ("completed", "errored")
DEADLINE_PASSED = "the deadline passed"


@dataclass
class Turn:
    """One message of a task, as the client sent and saw it."""

    task_id: str
    index: int
    token: str
    message: str
    text: str  # the script's own text, before any tool results
    tool: bool  # it calls bash, whose effect the workspace keeps
    agent: str | None = None
    # It delegates to a subagent instead, whose whole text is this.
    child_text: str | None = None
    turn_id: str | None = None
    seen: dict[int, str] = field(default_factory=dict)  # seq -> raw JSON
    terminal_phase: str | None = None
    outcome: str = "pending"  # completed | errored | stuck | not_started | skipped
    adopted: bool = False  # its POST's response was lost; found in the log
    lost_responses: int = 0  # POSTs the client gave up on before the response came
    posts: int = 0
    hangups: int = 0  # the client hung up on purpose
    broken: int = 0  # connections that failed under the client
    hitl_request_id: str | None = None
    hitl_answered: bool = False
    # outcome_unknown requests (an effectful call whose runner was killed mid-run,
    # #26): never hidden from the client; each is answered "failed" at once.
    unknown_outcomes: list[str] = field(default_factory=list)
    settling: str | None = None
    violations: list[str] = field(default_factory=list)


@dataclass
class Read:
    status: int | None  # None: no response (connection failed)
    body: Any = None
    headers: httpx.Headers | None = None
    error: str | None = None
    stopped: bool = False  # the client hung up (limit or stop condition)


class TaskClient:
    """Runs the turns of one task, in order, against whichever gateways live."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        cluster: ChaosCluster,
        key: str,
        task_id: str,
        turns: list[Turn],
        *,
        turn_deadline: float,
        run_deadline: float,
        hangup_chance: float,
        lost_response_chance: float,
        hitl_gate: asyncio.Event,
        on_hitl: Callable[[Turn], None],
    ) -> None:
        self.http = http
        self.cluster = cluster
        self.key = key
        self.task_id = task_id
        self.turns = turns
        self.turn_deadline = turn_deadline
        self.run_deadline = run_deadline
        self.hangup_chance = hangup_chance
        self.lost_response_chance = lost_response_chance
        self.hitl_gate = hitl_gate
        self.on_hitl = on_hitl
        self.cursor = 0  # last seq this client saw of the task
        self.known_turns: set[str] = set()
        self.blocked: str | None = None  # why the task cannot take messages any more
        self.lookup_violations: list[str] = []  # stream checks failed on look-up reads
        self.errors: Counter[str] = Counter()  # why connections failed, by kind

    async def run(self) -> None:
        for turn in self.turns:
            if self.blocked is not None or time.monotonic() > self.run_deadline:
                turn.outcome = "skipped"
                continue
            await self._turn(turn)

    # -- one turn --------------------------------------------------------------
    async def _turn(self, turn: Turn) -> None:
        # A turn started in time gets its whole deadline, even past the run's.
        deadline = time.monotonic() + self.turn_deadline
        if not await self._start(turn, deadline):
            return
        assert turn.turn_id is not None
        self.known_turns.add(turn.turn_id)
        while turn.terminal_phase is None:
            if time.monotonic() > deadline:
                turn.outcome = "stuck"
                turn.violations.append(
                    f"turn {turn.turn_id} of {self.task_id} did not end within "
                    f"{self.turn_deadline:g} s (last seq seen {self.cursor})"
                )
                self.blocked = "a turn never ended"
                return
            if turn.settling is not None:
                await self._answer(turn, deadline, turn.settling, "failed")
                turn.settling = None
                continue
            if turn.hitl_request_id and not turn.hitl_answered:
                # The driver restarts everything once every prompt is out.
                try:
                    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                        await self.hitl_gate.wait()
                except TimeoutError:
                    pass
                await self._answer(turn, deadline, turn.hitl_request_id, "yes")
                turn.hitl_answered = True
                continue
            url = await self._gateway()
            if url is None:
                continue
            params: dict[str, Any] = {"task_id": self.task_id}
            headers = {}
            # Both ways of giving the cursor are used.
            if random.random() < 0.5:
                params["after_seq"] = self.cursor
            else:
                headers["Last-Event-ID"] = str(self.cursor)
            read = await self._read(
                turn,
                "GET",
                f"{url}/execute/replay",
                deadline=deadline,
                params=params,
                headers=headers,
            )
            if turn.terminal_phase is not None:
                break
            if read.status != 200 or read.error is not None:
                turn.broken += 1
                await asyncio.sleep(random.uniform(0.05, 0.3))
            elif read.stopped:
                turn.hangups += 1
            else:
                # The replay ended without the turn's end: no turn held the task
                # at that moment (a resume is about to take it). Look again.
                await asyncio.sleep(0.2)
        turn.outcome = turn.terminal_phase
        self.cursor = max(self.cursor, max(turn.seen))

    async def _start(self, turn: Turn, deadline: float) -> bool:
        """POST the message until a turn is known to exist for it; False if none ever did."""
        body: dict[str, Any] = {"message": turn.message, "task_id": self.task_id}
        if turn.agent:
            body["agent"] = turn.agent
        busy_since: float | None = None
        while time.monotonic() < deadline:
            url = await self._gateway()
            if url is None:
                continue
            turn.posts += 1
            # Now and then, give up on the request before its response can
            # arrive: the gateway may have accepted it, or not even seen it.
            lose = random.random() < self.lost_response_chance
            give_up = time.monotonic() + random.uniform(0.0, 0.05) if lose else deadline
            read = await self._read(
                turn,
                "POST",
                f"{url}/execute",
                deadline=give_up,
                json=body,
                post=True,
                # The message's key: a POST that lands late (its gateway stalled)
                # after this client sent the message again starts no second turn.
                headers={"Idempotency-Key": turn.token},
            )
            if lose and read.status is None:
                turn.lost_responses += 1
                await asyncio.sleep(1.0)  # let a request still in flight land
            if read.status == 200:
                assert read.headers is not None
                turn.turn_id = read.headers["x-turn-id"]
                if read.stopped:
                    turn.hangups += 1
                elif read.error is not None:
                    turn.broken += 1
                return True
            if read.status is None and not lose:
                turn.broken += 1
            if read.status == 409:
                busy_since = busy_since or time.monotonic()
            # The outcome of this POST is unknown: look for its turn in the log.
            found = await self._find_started(deadline)
            if found is not None:
                turn.turn_id = found
                turn.adopted = True
                return True
            if read.status == 409 and time.monotonic() - (busy_since or 0) > 30:
                holder = ((read.body or {}).get("details") or {}).get("turn_id")
                turn.outcome = "not_started"
                turn.violations.append(
                    f"task {self.task_id} refused new messages for 30 s (409 "
                    f"{(read.body or {}).get('error')}); the lock is held by {holder}, "
                    "which has no started event after the previous turn"
                )
                self.blocked = "409 forever"
                return False
            await asyncio.sleep(random.uniform(0.1, 0.4))
        turn.outcome = "not_started"
        turn.violations.append(f"no turn could be started for {self.task_id} #{turn.index}")
        self.blocked = "could not start"
        return False

    async def _find_started(self, deadline: float) -> str | None:
        """The turn id of a ``started`` after the cursor that this client does not know."""
        found: list[str] = []

        def unknown_started(data: dict[str, Any]) -> bool:
            if (
                data["type"] == "thread_lifecycle"
                and data["phase"] == "started"
                and data["turn_id"] not in self.known_turns
            ):
                found.append(data["turn_id"])
                return True
            return False

        for _ in range(20):
            if time.monotonic() > deadline:
                return None
            url = await self._gateway()
            if url is None:
                continue
            # A replay follows a running turn live; a few seconds show what is stored.
            read = await self._read(
                None,
                "GET",
                f"{url}/execute/replay",
                deadline=min(deadline, time.monotonic() + 3),
                params={"task_id": self.task_id, "after_seq": self.cursor},
                stop=unknown_started,
            )
            if found or read.error == DEADLINE_PASSED:
                return found[0] if found else None
            if found:
                return found[0]
            if read.status == 404:
                return None  # the task itself does not exist: nothing was accepted
            if read.status == 200 and read.error is None:
                return None
            await asyncio.sleep(0.2)  # the log could not be read; try again
        return None

    async def _answer(self, turn: Turn, deadline: float, request_id: str, answer: str) -> None:
        while time.monotonic() < deadline:
            url = await self._gateway()
            if url is None:
                continue
            try:
                response = await self.http.post(
                    f"{url}/hitl/respond",
                    json={
                        "task_id": self.task_id,
                        "request_id": request_id,
                        "answer": answer,
                    },
                    headers={"X-Engine-Key": self.key},
                )
            except httpx.HTTPError:
                turn.broken += 1
                await asyncio.sleep(0.2)
                continue
            error = response.json().get("error") if response.status_code != 200 else None
            # Answered by an earlier attempt whose response was lost: also fine.
            if response.status_code == 200 or error == "HITL_ALREADY_ANSWERED":
                return
            if response.status_code < 500:
                turn.violations.append(f"/hitl/respond answered {response.status_code}: {error}")
                return
            await asyncio.sleep(0.2)

    async def _gateway(self) -> str | None:
        url = self.cluster.pick_gateway()
        if url is None:  # every gateway is down (a full restart): wait for one
            await asyncio.sleep(0.2)
        return url

    # -- one connection --------------------------------------------------------
    async def _read(
        self,
        turn: Turn | None,
        method: str,
        url: str,
        *,
        deadline: float,
        post: bool = False,
        stop: Callable[[dict[str, Any]], bool] | None = None,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> Read:
        """One SSE request; events go into ``turn`` (and are checked) as they arrive."""
        limit = None
        if turn is not None and random.random() < self.hangup_chance:
            limit = random.randint(1, 25)
        expected = None if post else self.cursor + 1
        got = 0
        read = Read(None)
        try:
            # Bounded: a stream of a turn that never ends sends heartbeats forever.
            async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                async with aconnect_sse(
                    self.http,
                    method,
                    url,
                    headers={"X-Engine-Key": self.key, **(headers or {})},
                    **kwargs,
                ) as source:
                    response = source.response
                    read.status, read.headers = response.status_code, response.headers
                    if post and turn is not None and response.status_code == 200:
                        turn.turn_id = response.headers["x-turn-id"]
                    if response.status_code != 200:
                        await response.aread()
                        try:
                            read.body = response.json()
                        except ValueError:
                            read.body = {"error": response.text[:200]}
                        return read
                    async for sse in source.aiter_sse():
                        if sse.event == "heartbeat":
                            continue
                        data = json.loads(sse.data)
                        seq = int(data["seq"])
                        if sse.id != str(seq) or data["type"] != sse.event:
                            self._violation(turn, f"frame id/event differ from its data: {sse.id}")
                        if expected is not None and seq != expected:
                            self._violation(
                                turn, f"{self.task_id}: expected seq {expected}, got {seq} ({url})"
                            )
                        expected = seq + 1
                        if turn is not None:
                            self._take(turn, seq, sse.data, data)
                        if stop is not None and stop(data):
                            read.stopped = True
                            return read
                        got += 1
                        if turn is not None and self._stop_here(turn, data):
                            read.stopped = turn.terminal_phase is None
                            return read
                        if limit is not None and got >= limit:
                            read.stopped = True
                            return read
        except (httpx.HTTPError, SSEError) as exc:
            read.error = f"{type(exc).__name__}: {exc}"
            self.errors[type(exc).__name__] += 1
        except TimeoutError:
            read.error = DEADLINE_PASSED
        if read.status is not None and read.status != 200:
            self.errors[f"HTTP {read.status}"] += 1
        return read

    def _take(self, turn: Turn, seq: int, raw: str, data: dict[str, Any]) -> None:
        previous = turn.seen.get(seq)
        if previous is not None and previous != raw:
            turn.violations.append(f"{self.task_id} seq {seq} arrived twice with different data")
        turn.seen[seq] = raw
        self.cursor = max(self.cursor, seq)

    def _stop_here(self, turn: Turn, data: dict[str, Any]) -> bool:
        """Hang up after the turn's end, or at its permission prompt (answered later)."""
        if data.get("turn_id") != turn.turn_id:
            return False
        if data["type"] == "thread_lifecycle" and data["phase"] in TERMINAL_PHASES:
            turn.terminal_phase = data["phase"]
            return True
        if data["type"] == "hitl_request" and data.get("kind") == "outcome_unknown":
            if data["request_id"] not in turn.unknown_outcomes:
                turn.unknown_outcomes.append(data["request_id"])
                turn.settling = data["request_id"]
            return turn.settling is not None
        if data["type"] == "hitl_request" and not turn.hitl_answered:
            if turn.hitl_request_id is None:
                turn.hitl_request_id = data["request_id"]
                self.on_hitl(turn)
            return True
        return False

    def _violation(self, turn: Turn | None, message: str) -> None:
        if turn is not None:
            turn.violations.append(message)
        else:
            # A look-up read (no turn): still a stream guarantee broken.
            self.lookup_violations.append(message)
