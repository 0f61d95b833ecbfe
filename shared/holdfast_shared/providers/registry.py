"""Model choice: ``provider:model`` strings resolved to a provider instance.

Providers are configured from the SDKs' usual variables (``ANTHROPIC_API_KEY``,
``OPENAI_API_KEY``, ``GEMINI_API_KEY``/``GOOGLE_API_KEY`` and the base-URL
variables); ``scripted`` is always there. With ``HOLDFAST_MODEL`` unset, the
default is the first configured provider in the order Anthropic, OpenAI,
Gemini, else ``scripted``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass

from holdfast_shared.modelspec import DEFAULT_MODELS, parse_model_spec
from holdfast_shared.providers.base import Provider
from holdfast_shared.providers.scripted import ScriptedProvider


@dataclass(frozen=True, slots=True)
class ModelChoice:
    provider: Provider
    model: str


class UnknownModel(ValueError):
    pass


class ProviderRegistry:
    """Providers by name; built once per worker process."""

    def __init__(self, providers: list[Provider], default_model: str = "scripted") -> None:
        self._providers = {p.name: p for p in providers}
        self.default_model = default_model
        self.resolve(default_model)  # a bad default is an error at start, not mid-turn

    @property
    def names(self) -> list[str]:
        return sorted(self._providers)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], configured: str | None) -> ProviderRegistry:
        """Every provider whose key is present, and the default model.

        Raises :class:`UnknownModel` when ``configured`` names an unknown
        provider or one whose key is missing.
        """
        providers: list[Provider] = [ScriptedProvider.from_env(environ)]
        for name in DEFAULT_MODELS:
            module = importlib.import_module(f"holdfast_shared.providers.{name}")
            provider = module.from_env(environ)
            if provider is not None:
                providers.append(provider)
        present = {p.name for p in providers}
        default = configured or next(
            (f"{name}:{model}" for name, model in DEFAULT_MODELS.items() if name in present),
            "scripted",
        )
        return cls(providers, default)

    async def aclose(self) -> None:
        """Close the providers' HTTP clients (those that have one)."""
        for provider in self._providers.values():
            close = getattr(provider, "aclose", None)
            if close is not None:
                await close()

    def resolve(self, spec: str | None) -> ModelChoice:
        """``"anthropic:claude-…"`` → provider and model; ``None`` → the default."""
        try:
            parsed = parse_model_spec(spec or self.default_model)
        except ValueError as exc:
            raise UnknownModel(str(exc)) from exc
        provider = self._providers.get(parsed.provider)
        if provider is None:
            raise UnknownModel(
                f"provider {parsed.provider!r} is not configured on this worker "
                "(set its API key variable)"
            )
        return ModelChoice(provider, parsed.model)
