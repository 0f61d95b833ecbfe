"""Model choice: ``provider:model`` strings resolved to a provider instance."""

from __future__ import annotations

from dataclasses import dataclass

from holdfast_shared.modelspec import parse_model_spec

from holdfast_loop_worker.providers.base import Provider
from holdfast_loop_worker.providers.scripted import ScriptedProvider

DEFAULT_MODEL = "scripted"


@dataclass(frozen=True, slots=True)
class ModelChoice:
    provider: Provider
    model: str


class UnknownModel(ValueError):
    pass


class ProviderRegistry:
    """Providers by name; built once per worker process."""

    def __init__(self, providers: list[Provider]) -> None:
        self._providers = {p.name: p for p in providers}

    @classmethod
    def default(cls) -> ProviderRegistry:
        return cls([ScriptedProvider()])

    def resolve(self, spec: str | None) -> ModelChoice:
        """``"anthropic:claude-…"`` → provider and model; ``None`` → the default."""
        try:
            parsed = parse_model_spec(spec or DEFAULT_MODEL)
        except ValueError as exc:
            raise UnknownModel(str(exc)) from exc
        provider = self._providers.get(parsed.provider)
        if provider is None:
            raise UnknownModel(f"provider {parsed.provider!r} is not configured on this worker")
        return ModelChoice(provider, parsed.model)
