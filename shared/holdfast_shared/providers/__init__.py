"""Model providers behind one streaming interface."""

from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    ModelRequest,
    Provider,
    ProviderError,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    ToolSpec,
    UsageReport,
)
from holdfast_shared.providers.registry import ModelChoice, ProviderRegistry, UnknownModel

__all__ = [
    "BlockStart",
    "BlockStop",
    "Finish",
    "ModelChoice",
    "ModelEvent",
    "ModelRequest",
    "Provider",
    "ProviderError",
    "ProviderRegistry",
    "TextChunk",
    "ThinkingChunk",
    "ToolInputChunk",
    "ToolSpec",
    "UnknownModel",
    "UsageReport",
]
