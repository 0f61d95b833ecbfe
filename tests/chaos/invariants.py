"""What must hold after a chaos run, checked against the final logs and PostgreSQL.

:func:`check` returns the violations (``[kind] message``) and the figures it
counted on the way. Nothing is skipped when the run went badly: a turn the
client gave up on still has to have a clean log.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.engine import make_url

from tests.chaos.client import Turn

TERMINAL = ("completed", "errored")


@dataclass
class Findings:
    violations: list[str] = field(default_factory=list)
    resumed_turns: int = 0
    resumed_events: int = 0
    discard_ranges: int = 0
    discard_ranges_with_started: int = 0
    tool_ok: int = 0
    tool_failed: int = 0
    unknown_outcomes: int = 0
    errored_turns: int = 0
    subagents: int = 0
    subagent_events: int = 0

    def add(self, kind: str, message: str) -> None:
        self.violations.append(f"[{kind}] {message}")


def pg_url(database_url: str) -> str:
    return make_url(database_url).set(drivername="postgresql").render_as_string(False)


async def pg_rows(database_url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(pg_url(database_url)) as conn:
        cursor = await conn.execute(query, params)
        return list(await cursor.fetchall())


async def engine_tasks(database_url: str, names: list[str]) -> dict[str, tuple[str, str]]:
    """The engine's (tenant id, task id) of each task the client named (the
    suite uses one tenant, so a name is one task)."""
    rows = await pg_rows(
        database_url, "SELECT name, tenant_id, id FROM tasks WHERE name = ANY(%s)", names
    )
    return {name: (tenant, task) for name, tenant, task in rows}


def workspace(root: Path, found: tuple[str, str]) -> Path:
    """A task's workspace under HOLDFAST_WORKSPACE_ROOT: by tenant, then engine task id."""
    return root / found[0] / found[1]


async def lease_owner(database_url: str, turn_id: str) -> str | None:
    rows = await pg_rows(database_url, "SELECT lease_owner FROM turns WHERE id = %s", turn_id)
    return rows[0][0] if rows else None


def visible_text(events: list[dict[str, Any]]) -> str:
    """A turn's text as a client shows it: its deltas minus the discarded ranges."""
    dropped = discarded(events)
    deltas = [e for e in events if e["type"] == "text_delta" and e["seq"] not in dropped]
    return "".join(e["text"] for e in deltas)


def discarded(events: list[dict[str, Any]]) -> set[int]:
    """The seqs a client drops: every range a ``turn_resumed`` names."""
    out: set[int] = set()
    for e in events:
        if e["type"] == "turn_resumed" and e.get("discard_from_seq") is not None:
            out.update(range(e["discard_from_seq"], e["discard_to_seq"] + 1))
    return out


def children_of(logs: dict[str, list[str]]) -> list[str]:
    """The subagent tasks the logs' delegate calls started (``subagent_started``)."""
    names: list[str] = []
    for raw in logs.values():
        for line in raw:
            if '"subagent_started"' in line:
                name = json.loads(line)["subagent"]["task_id"]
                names += [name] if name not in names else []
    return names


async def check(
    tasks: dict[str, list[Turn]],
    logs: dict[str, list[str]],
    workspaces: Path,
    database_url: str,
    children: dict[str, list[str]] | None = None,
) -> Findings:
    """``children``: the logs of the subagent tasks (:func:`children_of`), when
    turns delegate."""
    found = Findings()
    engine = await engine_tasks(database_url, list(tasks))
    name_of = {task: name for name, (_, task) in engine.items()}
    pg_events: dict[str, list[tuple[int, str]]] = {}
    for task_id, seq, data in await pg_rows(
        database_url,
        "SELECT task_id, seq, data FROM events WHERE task_id = ANY(%s) ORDER BY task_id, seq",
        list(name_of),
    ):
        pg_events.setdefault(name_of[task_id], []).append((seq, data))
    ok_tokens: set[str] = set()
    for task_id, turns in tasks.items():
        ok_tokens |= _check_log(found, task_id, turns, logs[task_id], pg_events.get(task_id, []))
        for turn in turns:
            if turn.child_text is not None and turn.turn_id is not None:
                _check_delegation(found, turn, logs[task_id], children or {})
        if task_id not in engine:
            found.add("messages", f"{task_id}: no such task in PostgreSQL")
            continue
        effects = workspace(workspaces, engine[task_id]) / "effects.log"
        _check_effects(found, task_id, turns, effects, ok_tokens)
    await _check_database(found, tasks, [task for _, task in engine.values()], database_url)
    return found


def _check_log(
    found: Findings,
    task_id: str,
    turns: list[Turn],
    raw: list[str],
    archived: list[tuple[int, str]],
) -> set[str]:
    """The task's log, and each of its turns in it; returns the tokens whose tool ran."""
    events = [json.loads(r) for r in raw]
    seqs = [e["seq"] for e in events]
    if seqs != list(range(1, len(seqs) + 1)):
        found.add("log", f"{task_id}: seqs are not 1..{len(seqs)}")
    if any(b["timestamp"] <= a["timestamp"] for a, b in itertools.pairwise(events)):
        found.add("log", f"{task_id}: timestamps do not strictly increase")
    if archived != list(zip(seqs, raw, strict=True)):
        logged = dict(zip(seqs, raw, strict=True))
        kept = dict(archived)
        differ = [s for s in sorted(set(logged) | set(kept)) if logged.get(s) != kept.get(s)]
        first = differ[0]
        found.add(
            "archive",
            f"{task_id}: the PostgreSQL copy differs from the log at {len(differ)} seqs "
            f"{differ[:5]}; at {first}: log {str(logged.get(first))[:160]} / "
            f"PostgreSQL {str(kept.get(first))[:160]}",
        )
    by_seq = dict(zip(seqs, raw, strict=True))
    known = {t.turn_id for t in turns if t.turn_id}
    unknown = Counter(e["turn_id"] for e in events if e["turn_id"] and e["turn_id"] not in known)
    for turn_id, count in unknown.items():
        # A turn no client message of this run was answered with: a message run twice?
        found.add("log", f"{task_id}: {count} events of turn {turn_id}, which no client started")
    _check_writers(found, task_id, events)
    ok_tokens: set[str] = set()
    for turn in turns:
        if turn.turn_id is not None:
            mine = [e for e in events if e["turn_id"] == turn.turn_id]
            if _check_turn(found, turn, mine, by_seq):
                ok_tokens.add(turn.token)
    return ok_tokens


def _check_writers(found: Findings, task_id: str, events: list[dict[str, Any]]) -> None:
    """One writer at a time: each turn's events lie between its ``started`` and its end,
    and turns of a task do not overlap.

    A worker that stalled past its lease and woke up after another took its
    turn over (or after the turn ended and the next began) would log outside
    those bounds; its appends must be refused (fenced) instead.
    """
    spans: dict[str, list[int]] = {}
    for e in events:
        if e["turn_id"]:
            spans.setdefault(e["turn_id"], []).append(e["seq"])
    bounds: list[tuple[int, int, str]] = []
    for turn_id, seqs in spans.items():
        mine = [e for e in events if e["turn_id"] == turn_id]
        starts = [e["seq"] for e in mine if _phase(e) == "started"]
        ends = [e["seq"] for e in mine if _phase(e) in TERMINAL]
        if not starts or not ends:
            continue  # the "terminal" check reports it
        outside = [s for s in seqs if s < min(starts) or s > max(ends)]
        if outside:
            found.add("writer", f"{task_id}: turn {turn_id} logged {outside[:5]} outside its span")
        bounds.append((min(starts), max(ends), turn_id))
    for (_, end, a), (start, _, b) in itertools.pairwise(sorted(bounds)):
        if start < end:
            found.add("writer", f"{task_id}: turn {b} started (seq {start}) before {a} ended")


def _phase(event: dict[str, Any]) -> str | None:
    return event.get("phase") if event["type"] == "thread_lifecycle" else None


def _check_turn(
    found: Findings, turn: Turn, logged: list[dict[str, Any]], by_seq: dict[int, str]
) -> bool:
    """One turn's events; True when its tool ran and its result was logged."""
    name = f"{turn.turn_id} ({turn.task_id} #{turn.index})"
    # Its own: a subagent's events it mirrored are checked by _check_delegation.
    mine = [e for e in logged if not e.get("subagent")]
    lifecycle = [e for e in mine if e["type"] == "thread_lifecycle"]
    started = [e for e in lifecycle if e["phase"] == "started"]
    ends = [e for e in lifecycle if e["phase"] in TERMINAL]
    resumes = [e for e in mine if e["type"] == "turn_resumed"]
    found.resumed_turns += bool(resumes)
    found.resumed_events += len(resumes)
    for e in resumes:
        if e.get("discard_from_seq") is not None:
            found.discard_ranges += 1
            # (A range reaching back to the turn's own "started" event.)
            found.discard_ranges_with_started += any(
                e["discard_from_seq"] <= s["seq"] for s in started
            )
    if len(started) != 1 or len(ends) != 1:
        found.add(
            "terminal",
            f"{name}: lifecycle events {[(e['seq'], e['phase']) for e in lifecycle]}",
        )
        if not started or not ends:
            return False
    first, last, phase = started[0]["seq"], ends[0]["seq"], ends[0]["phase"]
    if phase == "errored":
        found.errored_turns += 1
        error = next((e for e in mine if e["type"] == "error"), {})
        found.add("errored", f"{name}: {error.get('error')}: {error.get('message')}")
    if turn.terminal_phase is not None:
        # Everything the client received, over all its connections, is the log
        # (the subagent's events it mirrored included).
        wanted = {s: by_seq[s] for s in range(first, last + 1)}
        got = {s: d for s, d in turn.seen.items() if first <= s <= last}
        if got != wanted:
            missing = sorted(set(wanted) - set(got))
            differ = [s for s in got if got[s] != wanted.get(s)]
            found.add("client-view", f"{name}: missing {missing[:5]}, different {differ[:5]}")
    # An effectful call whose runner was killed mid-run (#26): never hidden, always
    # asked about, and the model still sees one result (the "tools" check below).
    unknown = [e for e in mine if e["type"] == "tool_outcome_unknown"]
    settles = [
        e for e in mine if e["type"] == "hitl_request" and e.get("kind") == "outcome_unknown"
    ]
    found.unknown_outcomes += len(unknown)
    if len(settles) != len(unknown):
        found.add("unknown-outcomes", f"{name}: {len(unknown)} unknown, {len(settles)} asked")
    if turn.agent is not None:  # its permission prompt: asked once, answered once ("yes")
        asked = [e for e in mine if e["type"] == "hitl_request" and e.get("kind") == "permission"]
        prompts = {e["request_id"] for e in asked}
        answered = [e for e in mine if e["type"] == "hitl_resolved" and e["request_id"] in prompts]
        if len(asked) != 1 or len(answered) != 1 or answered[0].get("answer") != "yes":
            found.add("hitl", f"{name}: {len(asked)} prompts, answers {answered}")
    results = [e for e in mine if e["type"] == "tool_result"]
    if len(results) != int(turn.tool or turn.child_text is not None):
        found.add("tools", f"{name}: {len(results)} tool results")
    ran = False
    for r in results if turn.tool else ():
        if r.get("error") is None and (r.get("output") or {}).get("exit_code") == 0:
            found.tool_ok += 1
            ran = True
        else:
            found.tool_failed += 1
    if phase == "completed":
        _check_text(found, name, turn, mine, results, resumes)
    return ran


def _check_text(
    found: Findings,
    name: str,
    turn: Turn,
    mine: list[dict[str, Any]],
    results: list[dict[str, Any]],
    resumes: list[dict[str, Any]],
) -> None:
    """The text a client shows (discarded ranges dropped) is the script's, once."""
    text = visible_text(mine)
    rest = text.removeprefix(turn.text)
    ok = rest != text or not turn.text
    summary = [{k: r[k] for k in ("output", "error") if r.get(k) is not None} for r in results]
    if ok and (turn.tool or turn.child_text is not None):
        # The model answers a tool result with "Tool results: <json>"; the JSON
        # went through PostgreSQL (JSONB), so its keys may come in another order.
        prefix = "Tool results: "
        try:
            ok = rest.startswith(prefix) and json.loads(rest[len(prefix) :]) == summary
        except json.JSONDecodeError:
            ok = False
    elif ok:
        ok = rest == ""
    if not ok:
        ranges = [(e["seq"], e.get("discard_from_seq"), e.get("discard_to_seq")) for e in resumes]
        found.add(
            "text",
            f"{name}: visible text ({len(text)} chars) is not the script's "
            f"({len(turn.text)} + tool answer); turn_resumed (seq, from, to): {ranges}; "
            f"after the script's text: {rest[:100]!r}; logged results: {str(summary)[:100]}",
        )


def _check_delegation(
    found: Findings, turn: Turn, raw: list[str], children: dict[str, list[str]]
) -> None:
    """A delegating turn: one child task for its call, whose answer is the
    call's result, and each of whose events the parent's log holds once, in
    the child's order — whatever was killed on the way."""
    name = f"{turn.turn_id} ({turn.task_id} #{turn.index})"
    events = [json.loads(r) for r in raw]
    mirrored = [e for e in events if e["turn_id"] == turn.turn_id and e.get("subagent")]
    started = {e["subagent"]["task_id"] for e in mirrored if e["type"] == "subagent_started"}
    completed = [e for e in mirrored if e["type"] == "subagent_completed"]
    if len(started) != 1 or len(completed) != 1:
        found.add("subagent", f"{name}: children {started}, {len(completed)} completions")
        return
    child = started.pop()
    found.subagents += 1
    copied = [e for e in mirrored if "seq" in e["subagent"]]
    found.subagent_events += len(copied)
    child_seqs = [e["subagent"]["seq"] for e in copied]
    if child_seqs != sorted(set(child_seqs)):
        found.add("subagent", f"{name}: child events copied out of order or twice")
    if child not in children:
        found.add("subagent", f"{name}: the log of its child {child} was not read")
        return
    own = [json.loads(r) for r in children[child]]
    wanted = [e["seq"] for e in own if e["type"] != "thread_lifecycle"]
    if child_seqs != wanted:
        missing = sorted(set(wanted) - set(child_seqs))
        found.add("subagent", f"{name}: child {child} events not copied: {missing[:5]}")
    dropped = set()
    for e in copied:
        if e["type"] == "turn_resumed" and e.get("discard_from_seq") is not None:
            dropped.update(range(e["discard_from_seq"], e["discard_to_seq"] + 1))
    text = "".join(
        e["text"]
        for e in copied
        if e["type"] == "text_delta" and e["subagent"]["seq"] not in dropped
    )
    if text != turn.child_text or completed[0].get("status") != "completed":
        found.add(
            "subagent",
            f"{name}: child {child} {completed[0].get('status')}, its text as the parent "
            f"shows it {len(text)} chars, not {len(turn.child_text or '')}",
        )
    result = [e for e in events if e["turn_id"] == turn.turn_id and e["type"] == "tool_result"]
    if not any(r.get("output") == turn.child_text for r in result if not r.get("subagent")):
        found.add("subagent", f"{name}: the call's result is not the child's answer")


def _check_effects(
    found: Findings, task_id: str, turns: list[Turn], effects: Path, ok_tokens: set[str]
) -> None:
    """Each tool call's side effect at most once; exactly once when its result was logged."""
    lines = Counter(effects.read_text().split()) if effects.exists() else Counter()
    tokens = {t.token for t in turns if t.tool}
    for token, count in lines.items():
        if token not in tokens:
            found.add("effects", f"{task_id}: unexpected line {token!r}")
        elif count > 1:
            found.add("effects", f"{task_id}: {token} ran {count} times")
    for token in tokens & ok_tokens:
        if lines[token] != 1:
            found.add("effects", f"{task_id}: {token} has a result but ran {lines[token]} times")


async def _check_database(
    found: Findings, tasks: dict[str, list[Turn]], ids: list[str], database_url: str
) -> None:
    """Every accepted message stored once; turn rows agree with the logs; no open prompt.

    ``ids`` are the engine's ids of the tasks."""
    started = {t.turn_id: t for turns in tasks.values() for t in turns if t.turn_id}
    user_rows = await pg_rows(
        database_url,
        "SELECT turn_id, content FROM messages "
        "WHERE task_id = ANY(%s) AND role = 'user' AND position = 0",
        ids,
    )
    texts: dict[str, list[str]] = {}
    for turn_id, content in user_rows:
        texts.setdefault(turn_id, []).append(content["blocks"][0]["text"])
    for turn_id, turn in started.items():
        if texts.get(turn_id) != [turn.message]:
            found.add("messages", f"{turn_id}: stored user messages {len(texts.get(turn_id, []))}")
    for turn_id, task_id, status in await pg_rows(
        database_url, "SELECT id, task_id, status FROM turns WHERE task_id = ANY(%s)", ids
    ):
        turn = started.get(turn_id)
        if turn is None:
            found.add("messages", f"{task_id}: turn {turn_id} ({status}) accepted, never started")
        elif turn.outcome in TERMINAL and status != turn.outcome:
            found.add("turns", f"{turn_id}: status {status!r}, its log says {turn.outcome!r}")
    for (request_id,) in await pg_rows(
        database_url,
        "SELECT request_id FROM hitl_requests WHERE task_id = ANY(%s) AND status = 'pending'",
        ids,
    ):
        found.add("hitl", f"{request_id} is still pending")


async def dump(
    directory: Path, logs: dict[str, list[str]], ids: list[str], database_url: str
) -> None:
    """Leave the evidence next to the process logs: every log, turn row and snapshot."""
    ids = [task for _, task in (await engine_tasks(database_url, ids)).values()]
    turns = await pg_rows(
        database_url,
        "SELECT id, task_id, status, lease_owner, created_at, finished_at FROM turns "
        "WHERE task_id = ANY(%s) ORDER BY created_at",
        ids,
    )
    snapshots = await pg_rows(
        database_url,
        "SELECT turn_id, reason, created_at, state::text FROM channel_state_snapshots "
        "WHERE task_id = ANY(%s) ORDER BY id",
        ids,
    )
    await asyncio.to_thread(_write_evidence, directory, logs, turns, snapshots)


def _write_evidence(
    directory: Path,
    logs: dict[str, list[str]],
    turns: list[tuple[Any, ...]],
    snapshots: list[tuple[Any, ...]],
) -> None:
    directory.mkdir(exist_ok=True)
    for task_id, raw in logs.items():
        (directory / f"{task_id}.jsonl").write_text("".join(r + "\n" for r in raw))
    for name, rows in (("turns.tsv", turns), ("snapshots.tsv", snapshots)):
        (directory / name).write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
