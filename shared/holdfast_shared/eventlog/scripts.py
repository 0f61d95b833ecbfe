"""The event log's Lua scripts, read from the package's ``lua/`` files.

Each script is one file with its KEYS and ARGV at the top; ``mark.lua`` is a
function two scripts begin with. They run inside Redis because what they do
must be one step: an append assigns seq and timestamp and writes the envelope
in the same step that appends (``append.lua``); a copying pass takes its
claim and reads its first batch, and ends by marking and releasing, each in
one round trip.
"""

from __future__ import annotations

from importlib.resources import files


def _lua(name: str) -> str:
    return files(__package__).joinpath("lua", name).read_text(encoding="utf-8")


APPEND = _lua("append.lua")
MARK_ARCHIVED = _lua("mark.lua") + _lua("mark_archived.lua")
CLAIM_AND_READ = _lua("claim_and_read.lua")
MARK_AND_RELEASE = _lua("mark.lua") + _lua("mark_and_release.lua")
CLEAR_DIRTY = _lua("clear_dirty.lua")
