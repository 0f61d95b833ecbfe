"""What an MCP call gives the model: its content, or its error, with no secret in either.

A ``tools/call`` answer (the SDK's ``CallToolResult``) becomes a
:class:`~holdfast_shared.jobs.ToolOutcome`: ``output`` holds the content
blocks as MCP sends them (text, image, resource...) and the structured content
if any; a result the server flags ``isError`` is an ``error`` with its text (the
text blocks leave the output then: the model reads the error once).

Every outcome and every error passes :class:`Redactor` first: any value of the
server's credentials or environment (a server that prints its environment, an
error that echoes a token) is replaced before it can reach an event, a snapshot
or the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from holdfast_shared.jobs import ToolOutcome

REDACTED = "[redacted]"
# Shorter values are not taken for secrets: replacing "1" everywhere helps nobody.
_MIN_SECRET = 6


class Redactor:
    """Replaces each of ``secrets`` (long enough to be one) wherever it appears."""

    def __init__(self, secrets: Iterable[str]) -> None:
        found = {s for s in secrets if len(s) >= _MIN_SECRET}
        # Longest first, so a secret containing another is replaced whole.
        self._secrets = sorted(found, key=len, reverse=True)
        # Also as they appear inside JSON strings (quotes, backslashes escaped).
        self._encoded = sorted({json.dumps(s)[1:-1] for s in found} - found, key=len, reverse=True)

    def text(self, value: str) -> str:
        for secret in self._secrets:
            value = value.replace(secret, REDACTED)
        return value

    def value(self, value: Any) -> Any:
        """``value`` (JSON) with every secret replaced, at any depth."""
        if not self._secrets:
            return value
        dumped = json.dumps(value, ensure_ascii=False)
        cleaned = dumped
        for secret in (*self._encoded, *self._secrets):
            cleaned = cleaned.replace(secret, REDACTED)
        return value if cleaned == dumped else json.loads(cleaned)

    def outcome(self, outcome: ToolOutcome) -> ToolOutcome:
        return outcome.model_copy(
            update={
                "output": self.value(outcome.output),
                "error": self.text(outcome.error) if outcome.error is not None else None,
            }
        )


def _block(content: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = content.model_dump(by_alias=True, exclude_none=True, mode="json")
    return dumped


def call_outcome(result: Any) -> ToolOutcome:
    """A ``CallToolResult`` as the model sees it."""
    content = [_block(block) for block in result.content or ()]
    structured = result.structured_content
    if not result.is_error:
        output: dict[str, Any] = {"content": content}
        if structured is not None:
            output["structuredContent"] = structured
        return ToolOutcome(output=output)
    # The text is the error; the output keeps only what the error does not say
    # (an image, structured content), so the model reads the text once.
    text = " ".join(b.get("text", "") for b in content if b.get("type") == "text").strip()
    rest = [b for b in content if b.get("type") != "text"]
    kept: dict[str, Any] = {"content": rest} if rest else {}
    if structured is not None:
        kept["structuredContent"] = structured
    return ToolOutcome(output=kept or None, error=text or "the MCP tool reported an error")
