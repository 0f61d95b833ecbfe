"""The scripted provider's extractor: deterministic memories from a trajectory.

A learning call (``purpose="extraction"``) gets the rendered trajectory
(learning service ``render.py``): a ``## Current soul`` section, then the
turn with one ``User: …`` line per user message. This reads the user's
lines with a few plain rules, so the whole learning path — extraction,
merging, superseding, the graph, the soul — runs in tests without a model:

* every declarative sentence the user wrote (not a question, not a request,
  not a ``/script``) is a fact, turned to the third person ("My dog is Rex"
  → "The user's dog is Rex"); "my X is/are …" and "I live/work …" get a key,
  so a later "my X is …" supersedes the earlier one;
* "<Name> is my <role>", "<Name> works at <Org>", "I work at <Org>" and
  "project <Name>" make social-graph entities and relations;
* "I prefer / like / love / hate / always / never …" and "My name is …"
  lines join the soul;
* the episode is the user's first line and the outcome.

A trajectory containing ``[learning-fails]`` makes the call fail, so tests
can drive the retries and the dead letters.
"""

from __future__ import annotations

import re
from typing import Any

FAIL_MARK = "[learning-fails]"

_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_REQUEST = re.compile(
    r"^(please|can|could|would|will|help|tell|show|what|who|where|when|why|how|which|do|does|"
    r"did|is|are|let's|lets|write|make|give|find|list|explain|run|create|remember)\b",
    re.IGNORECASE,
)
_MY_IS = re.compile(r"^(?:my|our) (?P<subject>[\w' -]{1,60}?) (?:is|are|was) (?P<rest>.+)$", re.I)
_I_VERB = re.compile(r"^i (?P<verb>live|work|study|am based) (?P<rest>.+)$", re.I)
_IS_MY = re.compile(
    r"^(?P<name>[A-Z][\w-]+(?: [A-Z][\w-]+)*) is my (?P<role>[\w -]{1,40}?)(?: (?:at|from) "
    r"(?P<org>[A-Z][\w&-]+(?: [A-Z][\w&-]+)*))?$"
)
_NAME = r"[A-Z][\w-]+(?: [A-Z][\w-]+)*"
_ORG = r"[A-Z][\w&-]+(?: [A-Z][\w&-]+)*"
_WORKS_AT = re.compile(rf"^(?P<name>{_NAME}) works (?:at|for) (?P<org>{_ORG})")
_I_WORK_AT = re.compile(rf"^I work (?:at|for) (?P<org>{_ORG})")
_PROJECT = re.compile(r"\bproject (?P<name>[A-Z][\w-]+)")
_SOUL = re.compile(
    r"^(?:i (?:prefer|like|love|hate|dislike|always|never|don't like|do not like)|"
    r"my name is|always|never)\b",
    re.IGNORECASE,
)


_MODALS = {"can", "could", "will", "would", "should", "must", "may", "might", "was", "shall"}
_IRREGULAR = {"have": "has", "am": "is", "'m": "is", "do": "does", "don't": "doesn't", "go": "goes"}


def _conjugated(verb: str) -> str:
    """``verb`` after "the user" instead of "I"."""
    lower = verb.casefold()
    if lower in _IRREGULAR:
        return _IRREGULAR[lower]
    if lower in _MODALS or not lower.isalpha():
        return verb
    if lower.endswith(("s", "sh", "ch", "x", "o")):
        return verb + "es"
    if lower.endswith("y") and lower[-2:-1] not in ("a", "e", "i", "o", "u"):
        return verb[:-1] + "ies"
    return verb + "s"


def _third_person(sentence: str) -> str:
    text = re.sub(r"^(?:my|our)\b", "The user's", sentence, flags=re.I)
    text = re.sub(r"^I'm\b", "The user is", text)
    text = re.sub(
        r"^I ((?:always|never|usually|often|sometimes|really|also|just|rarely|mostly) )?(\S+)",
        lambda m: f"The user {m[1] or ''}{_conjugated(m[2])}",
        text,
    )
    text = re.sub(r"\bmy\b", "the user's", text)
    text = re.sub(r"\bme\b", "the user", text)
    text = text.rstrip(" .!") + "."
    return text[0].upper() + text[1:]


def _slug(value: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", value.casefold().replace("'s", "")).strip("_")


def _sections(prompt: str) -> tuple[str, list[str], str]:
    soul_part, _, rest = prompt.partition("## Trajectory")
    soul = soul_part.partition("## Current soul")[2].strip()
    if soul == "(none)":
        soul = ""
    users = [
        line[len("User: ") :].strip() for line in rest.splitlines() if line.startswith("User: ")
    ]
    outcome = re.search(r"^Outcome: (\S+)", rest, flags=re.MULTILINE)
    return soul, users, outcome.group(1) if outcome else "completed"


def extract(prompt: str) -> dict[str, Any]:
    """The ``record_memory`` input for a rendered trajectory."""
    soul, users, outcome = _sections(prompt)
    facts: list[dict[str, Any]] = []
    entities: dict[tuple[str, str], dict[str, str]] = {}
    relations: list[dict[str, str]] = []
    soul_lines = [line for line in soul.splitlines() if line.startswith("- ")]
    for message in users:
        if message.startswith("/script"):
            continue
        for raw in _SENTENCE.split(message):
            sentence = raw.strip()
            if len(sentence.split()) < 3 or sentence.endswith("?") or _REQUEST.match(sentence):
                continue
            sentence = sentence.rstrip(".!")
            fact: dict[str, Any] = {"text": _third_person(sentence), "confidence": 0.9}
            if m := _MY_IS.match(sentence):
                fact["key"] = "user." + _slug(m["subject"])
            elif m := _I_VERB.match(sentence):
                fact["key"] = "user." + _slug(m["verb"])
            facts.append(fact)
            if m := _IS_MY.match(sentence):
                role = m["role"].strip()
                entities[("person", m["name"])] = {
                    "name": m["name"],
                    "kind": "person",
                    "description": f"the user's {role}",
                }
                if m["org"]:
                    entities[("organisation", m["org"])] = {
                        "name": m["org"],
                        "kind": "organisation",
                    }
                    relations.append(
                        {"source": m["name"], "relation": "works_at", "target": m["org"]}
                    )
            if m := _WORKS_AT.match(sentence):
                entities.setdefault(("person", m["name"]), {"name": m["name"], "kind": "person"})
                entities.setdefault(
                    ("organisation", m["org"]), {"name": m["org"], "kind": "organisation"}
                )
                relations.append({"source": m["name"], "relation": "works_at", "target": m["org"]})
            if m := _I_WORK_AT.match(sentence):
                entities[("organisation", m["org"])] = {
                    "name": m["org"],
                    "kind": "organisation",
                    "description": "where the user works",
                }
            for m in _PROJECT.finditer(sentence):
                entities.setdefault(("project", m["name"]), {"name": m["name"], "kind": "project"})
            if _SOUL.match(sentence):
                line = "- " + _third_person(sentence)
                if line not in soul_lines:
                    soul_lines.append(line)
    first = next((u for u in users if not u.startswith("/script")), users[0] if users else "")
    new_soul = "\n".join(soul_lines)
    return {
        "episode": {
            "summary": f"The user said: {first[:300]}" if first else "An empty turn.",
            "outcome": outcome,
            "participants": sorted({e["name"] for e in entities.values() if e["kind"] == "person"}),
        },
        "facts": facts[:50],
        "entities": list(entities.values())[:50],
        "relations": relations[:50],
        "soul": new_soul if new_soul != soul else None,
    }
