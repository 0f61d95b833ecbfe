"""The text of a turn as it stands, with the output of cut-off model calls taken back."""

from __future__ import annotations

from typing import Any, cast

from holdfast_client.events import Event, Result, TextDelta, ThinkingDelta, TurnResumed


class TurnText:
    """Accumulates a turn's text and thinking from its events.

    Feed it every event a stream yields, in order. When a ``turn_resumed``
    names a discard range (the deltas of a model call that was cut off when
    a worker died, then run again from the start), the deltas in that range
    are removed, so :attr:`text` is always what the model finally said, not
    the interrupted attempt followed by the full one. :attr:`discarded`
    holds the seqs taken back, for a display that has printed them already.
    A turn sent with an ``output_schema`` ends with its validated answer in
    :attr:`result` (from its ``result`` event; None before it). A subagent's
    events in the stream (``subagent`` set) are its child task's, not the
    turn's: they are left out (its answer is the ``delegate`` call's result).
    """

    def __init__(self) -> None:
        self._pieces: list[tuple[int, bool, str]] = []  # (seq, is_thinking, text)
        self.discarded: set[int] = set()
        self._text: str | None = ""
        self._thinking: str | None = ""
        self.result: Any = None

    def feed(self, event: Event) -> list[int]:
        """Take in one event; the seqs it discards (already fed), if it is a ``turn_resumed``."""
        if event.subagent is not None:
            return []
        kind = event.type
        if kind == "text_delta":
            self._pieces.append((event.seq, False, cast(TextDelta, event).text))
            self._text = None
            return []
        if kind == "thinking_delta":
            self._pieces.append((event.seq, True, cast(ThinkingDelta, event).text))
            self._thinking = None
            return []
        if isinstance(event, Result):
            self.result = event.result
            return []
        if isinstance(event, TurnResumed) and event.discard_from_seq is not None:
            gone = [seq for seq, _, _ in self._pieces if event.discards(seq)]
            if gone:
                self._pieces = [p for p in self._pieces if not event.discards(p[0])]
                self.discarded.update(gone)
                self._text = self._thinking = None
            return gone
        return []

    @property
    def text(self) -> str:
        """The turn's answer text so far."""
        if self._text is None:
            self._text = "".join(t for _, thinking, t in self._pieces if not thinking)
        return self._text

    @property
    def thinking(self) -> str:
        """The turn's thinking so far."""
        if self._thinking is None:
            self._thinking = "".join(t for _, thinking, t in self._pieces if thinking)
        return self._thinking
