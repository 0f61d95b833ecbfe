"""What the event log hands back: a stored event, and where an append landed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """One event as stored: what an SSE frame needs, nothing parsed."""

    seq: int
    type: str
    data: str


@dataclass(frozen=True, slots=True)
class Appended:
    """Where an append landed: the first seq and each event's timestamp."""

    first_seq: int
    timestamps: tuple[int, ...]

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.timestamps) - 1


def seq_of(entry_id: str) -> int:
    """The seq of a stream entry id (``<seq>-0``)."""
    return int(entry_id.split("-", 1)[0])
