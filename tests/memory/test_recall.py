"""Recall: 50 facts told across 20 turns, 50 questions asked later in new tasks.

The facts are said the way a user says them, mixed into messages that also
ask for things; the questions come later, in other words, sharing at least
one content word (or its stem) with the fact — what full-text search alone
can find, with the scripted extractor. The right fact must be in the top 5
for at least 90 % of the questions.
"""

from __future__ import annotations

import secrets

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.memory.test_learning import learned, search, turn_id
from tests.processes import EngineProcesses
from tests.sse_client import execute

Sessions = async_sessionmaker[AsyncSession]

# (what the user says, a question asked later, a word the stored fact must contain)
FACTS: tuple[tuple[str, str, str], ...] = (
    ("My dog is called Rex.", "What is my dog called?", "Rex"),
    ("My cat Mochi hates thunderstorms.", "What does Mochi hate?", "thunderstorms"),
    ("I work as a nurse at the Royal Infirmary.", "Where do I work as a nurse?", "Infirmary"),
    ("My sister Anna lives in Lisbon.", "Where does my sister live?", "Lisbon"),
    ("I am allergic to peanuts.", "What am I allergic to?", "peanuts"),
    ("My favourite colour is dark green.", "Which colour is my favourite?", "green"),
    ("I drive a blue Honda Civic.", "What do I drive?", "Civic"),
    ("My wife's birthday is on March 14.", "When is my wife's birthday?", "March"),
    ("I drink green tea every morning.", "What do I drink in the morning?", "tea"),
    ("Our billing service runs on PostgreSQL 15.", "What does the billing service run on?", "15"),
    ("My son Leo plays the violin.", "Which instrument does Leo play?", "violin"),
    ("I moved to Berlin in 2019.", "When did I move to Berlin?", "2019"),
    ("The Atlas project deadline is June 30.", "What is the Atlas deadline?", "June"),
    ("My manager is called Priya Shah.", "Who is my manager?", "Priya"),
    ("I ran the Boston marathon in 3 hours 40 minutes.", "How fast did I run the marathon?", "3"),
    ("I am vegetarian.", "Am I a vegetarian?", "vegetarian"),
    ("My flat has two bedrooms and a balcony.", "How many bedrooms does my flat have?", "two"),
    ("I studied mechanical engineering at Delft.", "What did I study at Delft?", "mechanical"),
    ("I go to the gym on Tuesdays and Thursdays.", "Which days do I go to the gym?", "Tuesdays"),
    ("My phone is a Pixel 8.", "Which phone do I have?", "Pixel"),
    ("Our office is on the fourth floor.", "Which floor is our office on?", "fourth"),
    ("I practise Japanese every evening.", "When do I practise Japanese?", "evening"),
    ("My daughter starts school in September.", "When does my daughter start school?", "September"),
    ("The staging server runs Ubuntu 22.04.", "Which Ubuntu runs on the staging server?", "22.04"),
    ("I am afraid of flying.", "What am I afraid of?", "flying"),
    ("My grandmother was born in Naples.", "Where was my grandmother born?", "Naples"),
    ("I pay 1200 euros rent each month.", "How much rent do I pay?", "1200"),
    ("My favourite book is Dune.", "What is my favourite book?", "Dune"),
    ("I play football on Sunday mornings.", "When do I play football?", "Sunday"),
    ("My doctor told me to cut down on salt.", "What did my doctor tell me?", "salt"),
    ("The Acme client meeting is every second Friday.", "When is the Acme meeting?", "Friday"),
    ("My car insurance renews in November.", "When does my car insurance renew?", "November"),
    ("I keep my passwords in Bitwarden.", "Where do I keep my passwords?", "Bitwarden"),
    ("My brother Tom is a pilot.", "What does my brother Tom do?", "pilot"),
    ("Our deploys go through GitHub Actions.", "How do our deploys go out?", "GitHub"),
    ("I wake up at 6 am on weekdays.", "When do I wake up on weekdays?", "6"),
    ("My bank is Monzo.", "Which bank do I use?", "Monzo"),
    ("The wifi network at home is called Nightjar.", "What is my home wifi called?", "Nightjar"),
    ("I take the 8:15 train to work.", "Which train do I take to work?", "8:15"),
    ("My favourite restaurant is Taberna Sal.", "What is my favourite restaurant?", "Taberna"),
    ("I have a dentist appointment on the 12th.", "When is my dentist appointment?", "12th"),
    ("My laptop is a ThinkPad X1.", "What laptop do I use?", "ThinkPad"),
    ("I support Benfica.", "Which team do I support?", "Benfica"),
    ("Our team standup is at 9:30.", "When is the team standup?", "9:30"),
    ("My landlord is called Mr Okafor.", "What is my landlord called?", "Okafor"),
    ("I am saving for a trip to Patagonia.", "What am I saving for?", "Patagonia"),
    ("My blood type is O negative.", "What is my blood type?", "O negative"),
    ("The garage door code is on the fridge.", "Where is the garage door code?", "fridge"),
    ("I learned to swim when I was thirty.", "When did I learn to swim?", "thirty"),
    ("My nephew Kai turns ten in May.", "When does Kai turn ten?", "May"),
)

# How the 50 facts are told: 20 turns, each a request with facts said along the way.
_ASKS = (
    "Can you help me plan my week?",
    "Please draft a short note to my team.",
    "What should I cook tonight?",
    "Help me sort out my to-do list.",
)


def messages() -> list[str]:
    turns: list[list[str]] = [[] for _ in range(20)]
    for n, (said, _question, _word) in enumerate(FACTS):
        turns[n % 20].append(said)
    return [f"{' '.join(said)} {_ASKS[n % len(_ASKS)]}" for n, said in enumerate(turns)]


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_facts_told_in_twenty_turns_are_recalled_in_new_tasks(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    url, key = engine.url, api_keys["main"]
    user = f"recall-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=60) as client:
        told = [
            await execute(client, url, key, {"message": m, "user_id": user}) for m in messages()
        ]
        await learned(sessions, [turn_id(t) for t in told], within=60)
        misses = []
        for said, question, word in FACTS:
            hits = await search(client, url, key, question, user_id=user, limit=5)
            if not any(word in hit["text"] for hit in hits):
                misses.append((said, question, [hit["text"] for hit in hits]))
        # And in the context of a new task: what the model is shown for a question.
        for _said, question, word in FACTS[:5]:
            shown = await execute(
                client,
                url,
                key,
                {"message": f'/script {{"echo_notes": true}} {question}', "user_id": user},
            )
            assert word in shown.text, (question, shown.text)
    recall = 1 - len(misses) / len(FACTS)
    print(f"recall@5 over {len(FACTS)} questions: {recall:.0%}; misses: {misses}")
    assert recall >= 0.9, misses
