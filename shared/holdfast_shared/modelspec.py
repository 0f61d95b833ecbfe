"""``provider:model`` strings, checked the same way by the gateway and the workers."""

from __future__ import annotations

from dataclasses import dataclass

KNOWN_PROVIDERS = frozenset({"scripted"})


@dataclass(frozen=True, slots=True)
class ModelSpec:
    provider: str
    model: str

    def __str__(self) -> str:
        return f"{self.provider}:{self.model}"


def parse_model_spec(spec: str) -> ModelSpec:
    """Parse ``provider[:model]``; raises ValueError naming the problem."""
    provider, _, model = spec.strip().partition(":")
    if provider not in KNOWN_PROVIDERS:
        known = ", ".join(sorted(KNOWN_PROVIDERS))
        raise ValueError(f"unknown model provider {provider!r}; known providers: {known}")
    return ModelSpec(provider, model or provider)
