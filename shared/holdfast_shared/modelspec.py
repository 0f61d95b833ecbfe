"""``provider:model`` strings, checked the same way by the gateway and the workers."""

from __future__ import annotations

from dataclasses import dataclass

# Real providers in the order the default model is picked, each with the
# model used when a spec names only the provider.
DEFAULT_MODELS = {
    "anthropic": "claude-sonnet-4-5",
    "openai": "gpt-4.1",
    "gemini": "gemini-2.5-flash",
}
KNOWN_PROVIDERS = frozenset({"scripted", *DEFAULT_MODELS})
# The spec as a client writes it: a known provider, then optionally ``:model``
# in printable ASCII without spaces. The JSON Schema of the gateway's ``model``.
MODEL_SPEC_PATTERN = rf"^({'|'.join(sorted(KNOWN_PROVIDERS))})(:[!-~]+)?$"


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
    return ModelSpec(provider, model or DEFAULT_MODELS.get(provider, provider))
