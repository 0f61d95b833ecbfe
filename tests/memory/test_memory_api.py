"""``/memory`` and ``/learning/status`` over HTTP, against real engine processes.

Facts are told through the API; episodes and the social graph (written by
the learning service, which has no HTTP write of its own) are put in the
store directly where a test needs them. Each test uses end users of its
own, so brains never overlap between tests.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import TrajectoryRecord
from holdfast_shared.memory import Brain
from holdfast_shared.memory.store import (
    add_episode,
    add_relation,
    revise_soul,
    upsert_entity,
)
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.processes import EngineProcesses

pytestmark = pytest.mark.timeout(60)

NDJSON = {"content-type": "application/x-ndjson"}


class Api:
    """``/memory`` as one tenant calls it."""

    def __init__(self, client: httpx.AsyncClient, url: str, key: str) -> None:
        self.client = client
        self.url = url
        self.headers = {"X-Engine-Key": key}

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        return await self.client.request(method, self.url + path, headers=headers, **kw)

    async def tell(self, text: str, **fields: Any) -> dict[str, Any]:
        response = await self.request("POST", "/memory/knowledge", json={"text": text, **fields})
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    async def search(
        self, kind: str, q: str, user_id: str | None = None, **params: Any
    ) -> list[dict[str, Any]]:
        if user_id is not None:
            params["user_id"] = user_id
        response = await self.request("GET", f"/memory/{kind}/search", params={"q": q, **params})
        assert response.status_code == 200, response.text
        results: list[dict[str, Any]] = response.json()["results"]
        return results

    async def export(self, user_id: str) -> bytes:
        response = await self.request("GET", "/memory/export", params={"user_id": user_id})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"] == "application/x-ndjson"
        return response.content

    async def import_(self, user_id: str, body: bytes) -> httpx.Response:
        return await self.request(
            "POST", "/memory/import", params={"user_id": user_id}, content=body, headers=NDJSON
        )


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as http:
        yield http


@pytest.fixture
def main(client: httpx.AsyncClient, engine: EngineProcesses, api_keys: dict[str, str]) -> Api:
    return Api(client, engine.url, api_keys["main"])


@pytest.fixture
def other(client: httpx.AsyncClient, engine: EngineProcesses, api_keys: dict[str, str]) -> Api:
    return Api(client, engine.url, api_keys["other"])


def new_user() -> str:
    return f"user-{secrets.token_hex(5)}"


Sessions = async_sessionmaker[AsyncSession]


# -- knowledge -------------------------------------------------------------------


async def test_a_fact_told_is_found_and_told_again_merges(main: Api) -> None:
    user = new_user()
    first = await main.tell("The user's dog is called Rex.", user_id=user)
    assert first["action"] == "created" and first["supersedes"] is None
    assert first["sources"] == ["api"] and first["valid_to"] is None
    assert first["user_id"] == user
    again = await main.tell("the user's dog is called rex", user_id=user, confidence=0.5)
    assert again["action"] == "merged" and again["id"] == first["id"]
    assert again["confidence"] > first["confidence"]

    hits = await main.search("knowledge", "what is the dog called", user)
    assert [h["id"] for h in hits] == [first["id"]]
    hit = hits[0]
    assert hit["kind"] == "knowledge" and hit["text"] == "The user's dog is called Rex."
    assert hit["score"] > 0 and datetime.fromisoformat(hit["created_at"])
    assert hit["sources"] == ["api"]


async def test_a_contradiction_supersedes_and_keeps_the_history(main: Api) -> None:
    user = new_user()
    lisbon = await main.tell("The user lives in Lisbon.", key="user.home_city", user_id=user)
    porto = await main.tell("The user lives in Porto.", key="User.Home_City", user_id=user)
    assert porto["action"] == "superseded" and porto["supersedes"] == lisbon["id"]
    assert porto["key"] == "user.home_city"
    faro = await main.tell("The user lives in Faro.", key="user.home_city", user_id=user)

    # Only the current fact is an answer; the others are its history.
    hits = await main.search("knowledge", "where does the user live", user)
    assert [h["text"] for h in hits] == ["The user lives in Faro."]

    got = await main.request("GET", f"/memory/knowledge/{faro['id']}", params={"user_id": user})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["text"] == "The user lives in Faro." and body["valid_to"] is None
    assert [h["id"] for h in body["history"]] == [porto["id"], lisbon["id"]]
    assert body["history"][0]["superseded_by"] == faro["id"]
    assert body["history"][0]["valid_to"] is not None

    old = await main.request("GET", f"/memory/knowledge/{porto['id']}", params={"user_id": user})
    assert old.json()["superseded_by"] == faro["id"]
    assert [h["id"] for h in old.json()["history"]] == [lisbon["id"]]


async def test_deleting_a_fact_forgets_it_and_its_history(main: Api) -> None:
    user = new_user()
    old = await main.tell("The user's favourite colour is red.", key="colour", user_id=user)
    new = await main.tell("The user's favourite colour is blue.", key="colour", user_id=user)
    params = {"user_id": user}
    deleted = await main.request("DELETE", f"/memory/knowledge/{new['id']}", params=params)
    assert deleted.status_code == 204 and deleted.content == b""
    for fact_id in (new["id"], old["id"]):
        gone = await main.request("GET", f"/memory/knowledge/{fact_id}", params=params)
        assert gone.status_code == 404
        assert gone.json()["error"] == "MEMORY_NOT_FOUND"
    assert await main.search("knowledge", "favourite colour", user) == []
    again = await main.request("DELETE", f"/memory/knowledge/{new['id']}", params=params)
    assert again.status_code == 404 and again.json()["error"] == "MEMORY_NOT_FOUND"


async def test_requests_are_validated(main: Api) -> None:
    async def refused(method: str, path: str, field: str, **kw: Any) -> None:
        response = await main.request(method, path, **kw)
        assert response.status_code == 422, response.text
        body = response.json()
        assert body["error"] == "INVALID_REQUEST"
        assert any(field in e["loc"] for e in body["details"]["errors"]), body

    await refused("GET", "/memory/knowledge/search", "q")
    await refused("GET", "/memory/knowledge/search", "q", params={"q": ""})
    await refused("GET", "/memory/episodes/search", "limit", params={"q": "x", "limit": 0})
    await refused("GET", "/memory/social/search", "limit", params={"q": "x", "limit": 101})
    await refused("GET", "/memory/soul", "user_id", params={"user_id": "no spaces"})
    await refused("GET", "/memory/export", "user_id", params={"user_id": "-leading"})
    await refused("POST", "/memory/knowledge", "text", json={"text": " \n\u3000"})
    await refused("POST", "/memory/knowledge", "text", json={"text": "a\u0000b"})
    lone_surrogate = b'{"text": "a\\ud800b"}'
    headers = {"content-type": "application/json"}
    await refused("POST", "/memory/knowledge", "text", content=lone_surrogate, headers=headers)
    await refused("POST", "/memory/knowledge", "confidence", json={"text": "a", "confidence": 2})
    await refused("POST", "/memory/knowledge", "extra", json={"text": "a", "extra": 1})
    await refused("POST", "/memory/knowledge", "user_id", json={"text": "a", "user_id": "a b"})
    await refused("PUT", "/memory/soul", "content", json={"content": "x" * 20_001})
    await refused("DELETE", "/memory", "user_id", params={"user_id": "x" * 129})
    # Search with only stop words is no error: it finds nothing.
    assert await main.search("knowledge", "the of and", new_user()) == []


# -- brains ----------------------------------------------------------------------


async def test_each_user_has_a_brain_of_their_own(main: Api) -> None:
    alice, bob = new_user(), new_user()
    fact = await main.tell("Alice's sister is called Zoë.", user_id=alice)
    assert [h["id"] for h in await main.search("knowledge", "sister Zoë", alice)] == [fact["id"]]
    assert await main.search("knowledge", "sister Zoë", bob) == []
    # The tenant's own brain (no user_id) is another one still.
    assert fact["id"] not in [h["id"] for h in await main.search("knowledge", "sister Zoë")]
    for params in ({"user_id": bob}, {}):
        got = await main.request("GET", f"/memory/knowledge/{fact['id']}", params=params)
        assert got.status_code == 404 and got.json()["error"] == "MEMORY_NOT_FOUND"
        gone = await main.request("DELETE", f"/memory/knowledge/{fact['id']}", params=params)
        assert gone.status_code == 404
    assert (await main.export(bob)) == b""
    still = await main.request("GET", f"/memory/knowledge/{fact['id']}", params={"user_id": alice})
    assert still.status_code == 200


async def test_another_tenant_never_sees_the_brain(main: Api, other: Api) -> None:
    user = new_user()
    fact = await main.tell("The launch code word is periwinkle.", user_id=user)
    await main.request("PUT", "/memory/soul", json={"content": "Secretive.", "user_id": user})
    params = {"user_id": user}
    for method in ("GET", "DELETE"):
        response = await other.request(method, f"/memory/knowledge/{fact['id']}", params=params)
        assert response.status_code == 404, response.text
        assert response.json()["error"] == "MEMORY_NOT_FOUND"
    assert await other.search("knowledge", "launch code word periwinkle", user) == []
    assert await other.export(user) == b""
    soul = await other.request("GET", "/memory/soul", params=params)
    assert soul.json() == {"content": "", "version": 0, "updated_at": None, "versions": 0}
    # Forgetting "the same" user in the other tenant leaves this one's alone.
    forgot = await other.request("DELETE", "/memory", params=params)
    assert forgot.status_code == 200 and set(forgot.json()["deleted"].values()) == {0}
    assert [h["id"] for h in await main.search("knowledge", "periwinkle", user)] == [fact["id"]]


# -- the soul --------------------------------------------------------------------


async def test_the_soul_is_versioned(main: Api) -> None:
    user = new_user()
    params = {"user_id": user}
    empty = await main.request("GET", "/memory/soul", params=params)
    assert empty.status_code == 200
    assert empty.json() == {"content": "", "version": 0, "updated_at": None, "versions": 0}

    first = await main.request(
        "PUT", "/memory/soul", json={"content": "Prefers short answers.", "user_id": user}
    )
    assert first.status_code == 200, first.text
    assert first.json()["version"] == 1 and first.json()["versions"] == 1
    same = await main.request(
        "PUT", "/memory/soul", json={"content": "Prefers short answers.", "user_id": user}
    )
    assert same.json()["version"] == 1  # nothing new, no new version
    second = await main.request(
        "PUT",
        "/memory/soul",
        json={"content": "Prefers short answers. Writes Go.", "user_id": user},
    )
    assert second.json()["version"] == 2

    current = (await main.request("GET", "/memory/soul", params=params)).json()
    assert current["content"] == "Prefers short answers. Writes Go."
    assert current["version"] == 2 and current["versions"] == 2
    assert datetime.fromisoformat(current["updated_at"])
    versions = (await main.request("GET", "/memory/soul/versions", params=params)).json()
    assert [v["version"] for v in versions["versions"]] == [2, 1]
    assert versions["versions"][1]["content"] == "Prefers short answers."
    assert {v["source"] for v in versions["versions"]} == {"api"}
    # The tenant's own soul is another one.
    own = (
        await main.request("GET", "/memory/soul/versions", params={"user_id": new_user()})
    ).json()
    assert own == {"versions": []}


# -- export and import -----------------------------------------------------------


async def _fill(main: Api, sessions: Sessions, user: str) -> None:
    """A brain with something of every kind: facts with history, an episode,
    entities and a relation, two soul versions."""
    await main.tell("The user lives in Lisbon.", key="home", user_id=user)
    await main.tell("The user lives in Porto.", key="home", user_id=user)
    await main.tell("The user is allergic to peanuts.", user_id=user, confidence=0.9)
    brain = Brain("tenant-main", user)
    async with sessions.begin() as session:
        await add_episode(
            session,
            brain,
            summary="Planned a birthday dinner for Anna in Porto.",
            occurred_at=datetime(2025, 3, 1, 18, 30, 0, 123456, tzinfo=UTC),
            trajectory_id=f"turn_{secrets.token_hex(8)}",
            task_id="tk_dinner",
            outcome="completed",
            participants=["Anna", "the user"],
        )
        anna = await upsert_entity(session, brain, "Anna", "person", evidence="t1")
        acme = await upsert_entity(
            session,
            brain,
            "Acme Robotics",
            "organisation",
            description="Builds arms",
            evidence="t1",
        )
        await add_relation(session, brain, anna, "works at", acme, evidence="t1")
        await revise_soul(session, brain, "Likes dinners.", source="learning")
        await revise_soul(session, brain, "Likes dinners. Lives in Porto.", source="api")


def _kinds(export: bytes) -> list[str]:
    return [json.loads(line)["kind"] for line in export.splitlines()]


async def test_export_forget_import_round_trips_exactly(main: Api, sessions: Sessions) -> None:
    user = new_user()
    await _fill(main, sessions, user)
    exported = await main.export(user)
    assert exported.endswith(b"\n")
    kinds = _kinds(exported)
    # Facts (the superseded one included), then episodes, entities, relations, souls.
    assert kinds == ["fact"] * 3 + ["episode"] + ["entity"] * 2 + ["relation"] + ["soul"] * 2
    lines = [json.loads(line) for line in exported.splitlines()]
    closed = next(line for line in lines if line["kind"] == "fact" and line["valid_to"])
    assert closed["text"] == "The user lives in Lisbon." and closed["superseded_by"]
    assert {"id", "tenant_id", "user_id", "created_at", "updated_at", "sources"} <= set(lines[0])
    assert lines[3]["occurred_at"] == "2025-03-01T18:30:00.123456Z"
    assert await main.export(user) == exported  # stable

    forgot = await main.request("DELETE", "/memory", params={"user_id": user})
    assert forgot.status_code == 200, forgot.text
    assert forgot.json()["user_id"] == user
    deleted = forgot.json()["deleted"]
    assert deleted["knowledge"] == 3 and deleted["episodes"] == 1
    assert deleted["entities"] == 2 and deleted["relations"] == 1
    assert deleted["soul_versions"] == 2
    assert await main.export(user) == b""
    assert await main.search("knowledge", "peanuts", user) == []

    imported = await main.import_(user, exported)
    assert imported.status_code == 200, imported.text
    assert imported.json() == {
        "lines": 9,
        "created": {"fact": 3, "episode": 1, "entity": 2, "relation": 1, "soul": 2},
        "updated": {"fact": 0, "episode": 0, "entity": 0, "relation": 0, "soul": 0},
        "unchanged": {"fact": 0, "episode": 0, "entity": 0, "relation": 0, "soul": 0},
    }
    assert await main.export(user) == exported
    hits = await main.search("knowledge", "peanuts", user)
    assert hits and hits[0]["text"] == "The user is allergic to peanuts."
    social = await main.search("social", "Anna", user)
    assert social[0]["text"] == "Anna (person) — works at Acme Robotics"

    # Importing again changes nothing.
    again = await main.import_(user, exported)
    assert again.status_code == 200, again.text
    assert set(again.json()["created"].values()) == {0}
    assert set(again.json()["updated"].values()) == {0}
    assert again.json()["unchanged"] == {
        "fact": 3,
        "episode": 1,
        "entity": 2,
        "relation": 1,
        "soul": 2,
    }
    assert await main.export(user) == exported


async def test_import_upserts_by_id(main: Api) -> None:
    user = new_user()
    fact = await main.tell("The user's car is green.", user_id=user)
    line = json.loads(await main.export(user))
    line["text"] = "The user's car is dark green."
    line["confidence"] = 0.25
    imported = await main.import_(user, json.dumps(line).encode() + b"\n")
    assert imported.status_code == 200, imported.text
    assert imported.json()["updated"]["fact"] == 1 and imported.json()["created"]["fact"] == 0
    got = await main.request("GET", f"/memory/knowledge/{fact['id']}", params={"user_id": user})
    assert got.json()["text"] == "The user's car is dark green."
    assert got.json()["confidence"] == 0.25
    assert [h["id"] for h in await main.search("knowledge", "dark green car", user)] == [fact["id"]]


async def test_a_brain_imports_into_another_users(main: Api, sessions: Sessions) -> None:
    source, copy = new_user(), new_user()
    await _fill(main, sessions, source)
    exported = await main.export(source)
    imported = await main.import_(copy, exported)
    assert imported.status_code == 200, imported.text
    assert sum(imported.json()["created"].values()) == 9

    copied = await main.export(copy)
    original_ids = {json.loads(line).get("id") for line in exported.splitlines()} - {None}
    copied_lines = [json.loads(line) for line in copied.splitlines()]
    assert len(copied_lines) == 9 and {line["user_id"] for line in copied_lines} == {copy}
    # New ids: the copy never touches the original's rows.
    assert not original_ids & {line.get("id") for line in copied_lines}
    # The references follow: the relation joins the copied entities, the
    # closed fact points at the copied current one.
    entity_ids = {line["id"] for line in copied_lines if line["kind"] == "entity"}
    relation = next(line for line in copied_lines if line["kind"] == "relation")
    assert {relation["source_id"], relation["target_id"]} == entity_ids
    porto = next(line for line in copied_lines if line["text"] == "The user lives in Porto.")
    got = await main.request("GET", f"/memory/knowledge/{porto['id']}", params={"user_id": copy})
    assert [h["text"] for h in got.json()["history"]] == ["The user lives in Lisbon."]
    assert (await main.search("social", "Anna", copy))[0]["text"].endswith("Acme Robotics")

    assert await main.export(source) == exported  # the original is untouched
    again = await main.import_(copy, exported)
    assert sum(again.json()["unchanged"].values()) == 9
    assert await main.export(copy) == copied


async def test_an_import_never_writes_another_tenants_rows(main: Api, other: Api) -> None:
    user = new_user()
    fact = await main.tell("The vault is behind the painting.", user_id=user)
    exported = await main.export(user)
    # The other tenant takes the lines as its own: same ids, its tenant named.
    line = json.loads(exported)
    line.update(tenant_id="tenant-other", text="The vault is empty.")
    response = await other.import_(user, json.dumps(line).encode())
    assert response.status_code == 200, response.text
    assert response.json()["created"]["fact"] == 1
    theirs = json.loads(await other.export(user))
    assert theirs["id"] != fact["id"] and theirs["text"] == "The vault is empty."
    assert await main.export(user) == exported
    mine = await main.request("GET", f"/memory/knowledge/{fact['id']}", params={"user_id": user})
    assert mine.json()["text"] == "The vault is behind the painting."


async def test_a_bad_line_is_named_and_nothing_is_written(main: Api) -> None:
    user = new_user()
    now = datetime.now(UTC).isoformat()
    good = {
        "kind": "fact",
        "id": "fact_import_good_1",
        "text": "The user plays the cello.",
        "confidence": 0.7,
        "valid_from": now,
        "created_at": now,
        "updated_at": now,
    }
    bad = {**good, "id": "fact_import_bad_1", "text": "Another fact.", "confidence": 1.5}
    body = b"\n".join([json.dumps(good).encode(), b"", json.dumps(bad).encode(), b"{not json", b""])
    response = await main.import_(user, body)
    assert response.status_code == 422, response.text
    refusal = response.json()
    assert refusal["error"] == "INVALID_REQUEST"
    problems = refusal["details"]["errors"]
    assert [(e["line"], e["loc"]) for e in problems] == [
        (3, ["body", "line 3", "confidence"]),
        (4, ["body", "line 4"]),
    ]
    assert "line 3" in refusal["message"]
    assert await main.export(user) == b""
    assert await main.search("knowledge", "cello", user) == []

    # The good line alone goes in; lines of the same row twice do not.
    twice = json.dumps(good).encode() + b"\n" + json.dumps(good).encode()
    duplicate = await main.import_(user, twice)
    assert duplicate.status_code == 422
    assert duplicate.json()["details"]["errors"][0]["type"] == "duplicate"
    assert (await main.import_(user, json.dumps(good).encode())).status_code == 200
    assert [h["id"] for h in await main.search("knowledge", "cello", user)] == [good["id"]]


async def test_an_import_that_collides_with_the_brain_is_refused(main: Api) -> None:
    user = new_user()
    await main.tell("The user plays chess.", user_id=user)
    now = datetime.now(UTC).isoformat()
    same_text = {
        "kind": "fact",
        "id": "fact_import_collides",
        "text": "the user plays chess",
        "confidence": 0.7,
        "valid_from": now,
        "created_at": now,
        "updated_at": now,
    }
    relation = {
        "kind": "relation",
        "id": "rel_to_nowhere",
        "source_id": "ent_nowhere_a",
        "relation": "knows",
        "target_id": "ent_nowhere_b",
        "created_at": now,
    }
    body = json.dumps(same_text).encode() + b"\n" + json.dumps(relation).encode()
    response = await main.import_(user, body)
    assert response.status_code == 422, response.text
    problems = {(e["line"], e["loc"][-1], e["type"]) for e in response.json()["details"]["errors"]}
    assert problems == {
        (1, "text", "conflict"),
        (2, "source_id", "unknown_entity"),
        (2, "target_id", "unknown_entity"),
    }
    assert len(_kinds(await main.export(user))) == 1


async def test_import_takes_ndjson_only(main: Api) -> None:
    response = await main.request(
        "POST", "/memory/import", content=b"{}", headers={"content-type": "application/json"}
    )
    assert response.status_code == 415 and response.json()["error"] == "UNSUPPORTED_MEDIA_TYPE"
    empty = await main.import_(new_user(), b"")
    assert empty.status_code == 200 and empty.json()["lines"] == 0


async def test_forgetting_the_tenants_own_brain_leaves_its_users(main: Api, other: Api) -> None:
    # The other tenant, so no other test's tenant-wide memory is forgotten.
    user = new_user()
    await other.tell("The tenant's office is in Ghent.")
    await other.tell("This user's office is in Bruges.", user_id=user)
    forgot = await other.request("DELETE", "/memory")
    assert forgot.status_code == 200 and forgot.json()["user_id"] == ""
    assert forgot.json()["deleted"]["knowledge"] >= 1
    assert await other.search("knowledge", "office Ghent") == []
    assert len(await other.search("knowledge", "office Bruges", user)) == 1


# -- learning status -------------------------------------------------------------


async def test_learning_status(main: Api, other: Api, sessions: Sessions) -> None:
    async def status() -> dict[str, Any]:
        response = await main.request("GET", "/learning/status")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    before = await status()
    assert set(before) == {
        "lag_seconds",
        "pending",
        "processed",
        "failed",
        "retrying",
        "dead",
        "oldest_pending_at",
        "stream",
    }
    assert set(before["stream"]) == {"length", "group", "pending", "lag"}
    assert before["stream"]["length"] >= 0
    theirs = (await other.request("GET", "/learning/status")).json()

    user = new_user()
    now = datetime.now(UTC)
    ended = now - timedelta(days=3650)  # older than any other pending one

    def trajectory(status: str, attempts: int, **kw: Any) -> TrajectoryRecord:
        return TrajectoryRecord(
            id=f"turn_{secrets.token_hex(8)}",
            tenant_id="tenant-main",
            user_id=user,
            task_id="tk_status",
            outcome="completed",
            record={},
            started_at=ended,
            finished_at=ended,
            status=status,
            attempts=attempts,
            **kw,
        )

    async with sessions.begin() as session:
        session.add_all(
            [
                # Retried far in the future: no learner takes it during the test.
                trajectory("pending", 2, next_attempt_at=now + timedelta(days=1)),
                trajectory("done", 0, processed_at=now),
                trajectory("dead", 5, last_error="boom"),
            ]
        )
    after = await status()
    # At least: a learning service may be at work on other trajectories meanwhile.
    assert after["dead"] >= before["dead"] + 1
    assert after["failed"] >= before["failed"] + 2
    assert after["processed"] >= before["processed"] + 1
    assert after["retrying"] >= before["retrying"] + 1
    assert after["pending"] >= 1
    assert after["lag_seconds"] >= 3650 * 86400
    assert datetime.fromisoformat(after["oldest_pending_at"]) == ended

    # Another tenant's status does not count them.
    theirs_after = (await other.request("GET", "/learning/status")).json()
    assert (theirs_after["dead"], theirs_after["failed"]) == (theirs["dead"], theirs["failed"])
    await main.request("DELETE", "/memory", params={"user_id": user})  # its trajectories go too
    assert (await status())["dead"] == after["dead"] - 1


async def test_a_wrong_method_names_every_method_of_the_path(main: Api) -> None:
    # GET and PUT /memory/soul are two routes: the 405 lists both.
    response = await main.request("POST", "/memory/soul", json={})
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) == {"GET", "PUT"}
    assert response.json()["error"] == "METHOD_NOT_ALLOWED"
    fact = await main.request("PUT", "/memory/knowledge/fact_x")
    assert set(fact.headers["allow"].split(", ")) == {"GET", "DELETE"}
