"""The brain's storage and full-text retrieval, on the real PostgreSQL."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

import pytest
from holdfast_shared.memory import Brain
from holdfast_shared.memory.search import Searcher
from holdfast_shared.memory.store import (
    add_episode,
    add_relation,
    current_soul,
    delete_fact,
    fact_history,
    forget,
    get_fact,
    revise_soul,
    save_fact,
    upsert_entity,
)
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture
def brain(api_keys: dict[str, str]) -> Brain:
    # A user of its own per test: brains never see each other's rows.
    return Brain("tenant-main", f"u-{secrets.token_hex(4)}")


async def test_a_fact_told_twice_merges(sessions: Sessions, brain: Brain) -> None:
    async with sessions.begin() as session:
        first = await save_fact(session, brain, "The user's dog is called Rex.", source="t1")
        confidence = first.fact.confidence
        again = await save_fact(session, brain, "the user's dog is called rex", source="t2")
    assert (first.action, again.action) == ("created", "merged")
    assert again.fact.id == first.fact.id
    assert again.fact.sources == ["t1", "t2"]
    assert again.fact.confidence > confidence


async def test_a_contradiction_supersedes_with_history(sessions: Sessions, brain: Brain) -> None:
    async with sessions.begin() as session:
        old = await save_fact(
            session, brain, "The user lives in Lisbon.", key="user.home_city", source="t1"
        )
        new = await save_fact(
            session, brain, "The user lives in Porto.", key="user.home_city", source="t2"
        )
    assert new.action == "superseded" and new.previous is not None
    async with sessions() as session:
        closed = await get_fact(session, brain, old.fact.id)
        assert closed is not None and closed.valid_to is not None
        assert closed.superseded_by == new.fact.id
        history = await fact_history(session, new.fact)
        assert [f.id for f in history] == [old.fact.id]
        hits = await Searcher().search(session, brain, "where does the user live", limit=5)
    # Only the current fact is found; the old one is history, not an answer.
    assert [h.text for h in hits] == ["The user lives in Porto."]


async def test_search_finds_by_any_word_and_ranks_the_better_match_first(
    sessions: Sessions, brain: Brain
) -> None:
    async with sessions.begin() as session:
        await save_fact(session, brain, "The user's dog is called Rex.", source="t")
        await save_fact(session, brain, "The user's cat is called Tom.", source="t")
        await save_fact(session, brain, "The user's dog eats twice a day.", source="t")
        await add_episode(
            session,
            brain,
            summary="Helped the user plan a birthday party for Anna.",
            occurred_at=datetime.now(UTC),
            trajectory_id=f"turn_{secrets.token_hex(6)}",
        )
    async with sessions() as session:
        hits = await Searcher().search(
            session, brain, "what is the dog called?", kinds=("knowledge",), limit=3
        )
        episodes = await Searcher().search(session, brain, "birthday", kinds=("episodes",), limit=3)
    assert hits[0].text == "The user's dog is called Rex."
    assert {h.text for h in hits} >= {"The user's dog eats twice a day."}
    assert episodes and "birthday" in episodes[0].text


async def test_the_social_graph_is_searchable_with_its_relations(
    sessions: Sessions, brain: Brain
) -> None:
    async with sessions.begin() as session:
        alice = await upsert_entity(session, brain, "Alice Moreau", "person", evidence="t1")
        acme = await upsert_entity(
            session, brain, "Acme", "organisation", description="A robotics firm", evidence="t1"
        )
        await add_relation(session, brain, alice, "works at", acme, evidence="t1")
        again = await upsert_entity(session, brain, "alice moreau", "person", evidence="t2")
    assert again.id == alice.id and again.evidence == ["t1", "t2"]
    async with sessions() as session:
        hits = await Searcher().search(session, brain, "Alice", kinds=("social",))
    assert hits[0].text == "Alice Moreau (person) — works at Acme"
    assert hits[0].extra["relations"][0]["name"] == "Acme"


async def test_the_soul_keeps_every_version(sessions: Sessions, brain: Brain) -> None:
    async with sessions.begin() as session:
        await revise_soul(session, brain, "Prefers short answers.", source="api")
        await revise_soul(session, brain, "Prefers short answers.", source="api")
        second = await revise_soul(
            session, brain, "Prefers short answers. Writes Python.", source="api"
        )
    assert second.version == 2
    async with sessions() as session:
        soul = await current_soul(session, brain)
    assert soul is not None and soul.content.endswith("Writes Python.")


async def test_brains_are_separate_and_forgetting_one_user_leaves_the_rest(
    sessions: Sessions, brain: Brain
) -> None:
    neighbour = Brain(brain.tenant_id, brain.user_id + "-b")
    stranger = Brain("tenant-other", brain.user_id)
    async with sessions.begin() as session:
        for who in (brain, neighbour, stranger):
            await save_fact(session, who, "The office wifi password is hunter2.", source="t")
    async with sessions.begin() as session:
        counts = await forget(session, brain)
    assert counts["knowledge"] == 1
    async with sessions() as session:
        for who, found in ((brain, 0), (neighbour, 1), (stranger, 1)):
            hits = await Searcher().search(session, who, "wifi password")
            assert len(hits) == found


async def test_deleting_a_fact_takes_its_history(sessions: Sessions, brain: Brain) -> None:
    async with sessions.begin() as session:
        await save_fact(session, brain, "Deploys go to Heroku.", key="deploy.target", source="a")
        new = await save_fact(
            session, brain, "Deploys go to Fly.io.", key="deploy.target", source="b"
        )
    async with sessions.begin() as session:
        assert await delete_fact(session, brain, new.fact.id)
        assert not await delete_fact(session, brain, new.fact.id)
    async with sessions() as session:
        assert await Searcher().search(session, brain, "deploys") == []
