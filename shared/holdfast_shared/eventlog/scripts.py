"""The event log's Lua scripts, read from the package's ``lua/`` files.

Each script is one file with its KEYS and ARGV at the top; ``mark.lua`` is a
function two scripts begin with. They run inside Redis because what they do
must be one step: an append assigns seq and timestamp and writes the envelope
in the same step that appends (``append.lua``); a copying pass takes its
claim and reads its first batch, and ends by marking and releasing, each in
one round trip. :func:`eval_many` sends many calls of one script in one
pipeline (the copier's passes over many tasks).
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.resources import files
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError


def _lua(name: str) -> str:
    return files(__package__).joinpath("lua", name).read_text(encoding="utf-8")


APPEND = _lua("append.lua")
MARK_ARCHIVED = _lua("mark.lua") + _lua("mark_archived.lua")
CLAIM_AND_READ = _lua("claim_and_read.lua")
MARK_AND_RELEASE = _lua("mark.lua") + _lua("mark_and_release.lua")
CLEAR_DIRTY = _lua("clear_dirty.lua")


async def eval_many(
    redis: Redis,
    script: str,
    sha: str,
    calls: Sequence[tuple[Sequence[Any], Sequence[Any]]],
    *,
    raise_on_error: bool = True,
) -> list[Any]:
    """Each ``(keys, args)`` call of one script, in one pipeline; their replies in order.

    Loads the script and sends them all again when Redis lacks it (then none ran).
    Any other error of a call is raised after the pipeline, as redis-py does, or
    (``raise_on_error=False``) left in its place among the replies.
    """

    async def send() -> list[Any]:
        async with redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.evalsha(sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    if not calls:
        return []
    replies = await send()
    if any(isinstance(reply, NoScriptError) for reply in replies):
        await redis.script_load(script)
        replies = await send()
    for reply in replies:
        if isinstance(reply, Exception) and raise_on_error:
            raise reply
    return replies
