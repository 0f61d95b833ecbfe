"""Token accounting: how big a model's window is, and how big a context is.

The window comes from a table of known models (``HOLDFAST_CONTEXT_WINDOW``
overrides it). The size of an assembled context is estimated locally — four
characters a token, the way most tokenizers average over prose and JSON —
and then calibrated per task: each model call reports the prompt's real size
(``input_tokens``, cache reads and writes included), and the ratio of that to
the estimate is kept (a moving average, in the turn's state and with the
task) so the next estimate is in the provider's own units.

A report is believed only when it is plausible: between one and eight
characters a token (``PLAUSIBLE``, the calibration's bounds too). Servers
that report no usage (llama.cpp's) or a constant (1 token for any prompt)
leave the calibration where it was — the local estimate, to begin with — so
compaction still happens on time; the loop counts such a call's usage from
its estimates, marked ``estimated``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.tools import ToolSpec

# Longest prefix wins; the model name as the provider spells it.
_WINDOWS: tuple[tuple[str, int], ...] = (
    ("claude-", 200_000),
    ("gpt-4.1", 1_047_576),
    ("gpt-4o", 128_000),
    ("gpt-4-turbo", 128_000),
    ("gpt-5", 400_000),
    ("gpt-3.5-turbo", 16_385),
    ("o1", 200_000),
    ("o3", 200_000),
    ("o4-mini", 200_000),
    ("gemini-1.5-pro", 2_097_152),
    ("gemini-", 1_048_576),
    ("scripted", 200_000),
)
# A model nobody listed (a local server's, say): small enough to be safe.
UNKNOWN_WINDOW = 32_768

CHARS_PER_TOKEN = 4
# Per message: role, separators, block framing.
_MESSAGE_OVERHEAD = 4
# An image costs about this much whatever its bytes (the providers resize).
_IMAGE_TOKENS = 1_600
# Reported tokens per estimated token worth believing: 8 (CHARS_PER_TOKEN / 0.5)
# down to 1 (CHARS_PER_TOKEN / 4.0) characters a token.
PLAUSIBLE = (0.5, 4.0)
_CALIBRATION_WEIGHT = 0.5


def context_window(model: str, override: int | None = None) -> int:
    """The window of ``model`` (a bare model name), or ``override`` when set."""
    if override is not None:
        return override
    best = max(
        ((prefix, size) for prefix, size in _WINDOWS if model.startswith(prefix)),
        key=lambda found: len(found[0]),
        default=None,
    )
    return best[1] if best is not None else UNKNOWN_WINDOW


def text_tokens(text: str) -> int:
    return (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN


def _json_tokens(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return text_tokens(value)
    return text_tokens(json.dumps(value, separators=(",", ":"), default=str))


def block_tokens(block: Mapping[str, Any]) -> int:
    kind = block.get("type")
    if kind in ("text", "thinking"):
        return text_tokens(str(block.get("text", "")))
    if kind == "tool_use":
        return text_tokens(str(block.get("name", ""))) + _json_tokens(block.get("input"))
    if kind == "tool_result":
        return _json_tokens(block.get("output")) + _json_tokens(block.get("error"))
    return _json_tokens(dict(block))


def media_tokens(item: Mapping[str, Any]) -> int:
    if item.get("type") == "image":
        return _IMAGE_TOKENS
    data = item.get("data")
    # Base64 of a document: about one token per six decoded bytes of it.
    return len(data) // 8 if isinstance(data, str) else _IMAGE_TOKENS


def message_tokens(message: ChatMessage) -> int:
    return (
        _MESSAGE_OVERHEAD
        + sum(block_tokens(b) for b in message.blocks)
        + sum(media_tokens(m) for m in message.media)
    )


def tools_tokens(tools: Iterable[ToolSpec]) -> int:
    return sum(
        text_tokens(t.name) + text_tokens(t.description) + _json_tokens(t.input_schema)
        for t in tools
    )


def calibrated(estimate: int, calibration: float) -> int:
    """``estimate`` in the provider's units."""
    return int(estimate * calibration + 0.5)


def plausible(estimate: int, reported: int) -> bool:
    """Whether ``reported`` prompt tokens can be the size of a prompt estimated at
    ``estimate`` (raw); with no estimate to judge by, a report is taken as it is."""
    if estimate <= 0:
        return reported > 0
    low, high = PLAUSIBLE
    return low <= reported / estimate <= high


def sane_calibration(calibration: float | None) -> float:
    """``calibration`` within ``PLAUSIBLE`` (one stored before the bounds were
    this narrow is brought in); none yet: 1, the local estimate."""
    low, high = PLAUSIBLE
    return min(high, max(low, calibration or 1.0))


def recalibrate(calibration: float, estimate: int, reported: int) -> float:
    """The calibration after a call estimated at ``estimate`` (raw) was
    reported as ``reported`` prompt tokens: unchanged by an implausible report."""
    calibration = sane_calibration(calibration)
    if estimate <= 0 or not plausible(estimate, reported):
        return calibration
    return calibration + (reported / estimate - calibration) * _CALIBRATION_WEIGHT
