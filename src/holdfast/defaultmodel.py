"""The model ``holdfast up``'s loop-workers answer with when a turn names none, told
before they start, so the start banner can say it.

The loop-workers pick it in ``ProviderRegistry.from_env``: ``HOLDFAST_MODEL``,
else the first provider whose key is present (Anthropic, OpenAI, Gemini), else
``scripted``. That builds every provider's SDK client; the supervisor needs
only the name, so this reads the same variables without importing an SDK
(tests/cli/test_default_model.py holds the two to the same answer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from holdfast_shared.modelspec import DEFAULT_MODELS, parse_model_spec

# What turns each provider on, in the order the default is picked
# (each provider module's from_env).
PROVIDER_VARIABLES = {
    "anthropic": ("ANTHROPIC_API_KEY",),
    # OPENAI_BASE_URL alone is a local OpenAI-compatible server that needs no key.
    "openai": ("OPENAI_API_KEY", "OPENAI_BASE_URL"),
    "gemini": ("GEMINI_API_KEY", "GOOGLE_API_KEY"),
}
HOW_TO_SET = (
    "for a real one set ANTHROPIC_API_KEY, OPENAI_API_KEY or GEMINI_API_KEY "
    "(and HOLDFAST_MODEL=provider:model to pick, e.g. anthropic:claude-sonnet-4-5); "
    "a local OpenAI-compatible server: OPENAI_BASE_URL=http://127.0.0.1:11434/v1 "
    "HOLDFAST_MODEL=openai:llama3.1"
)


@dataclass(frozen=True, slots=True)
class DefaultModel:
    spec: str  # provider:model, as the usage events name it
    why: str  # what chose it

    @property
    def scripted(self) -> bool:
        return self.spec.startswith("scripted:")

    def describe(self) -> str:
        """One paragraph for the start banner."""
        if self.scripted:
            return (
                f"{self.spec} ({self.why}): built in, no network; it echoes each message "
                "(`You said: …`) and follows `/script {…}` messages, see README "
                f'"Using it"; {HOW_TO_SET}'
            )
        return f"{self.spec} ({self.why})"


def default_model(configured: str | None, environ: Mapping[str, str]) -> DefaultModel:
    """The loop-workers' default model for ``HOLDFAST_MODEL`` = ``configured`` and
    the provider variables in ``environ``."""
    if configured:
        return DefaultModel(str(parse_model_spec(configured)), "HOLDFAST_MODEL")
    for provider, variables in PROVIDER_VARIABLES.items():
        found = next((v for v in variables if environ.get(v)), None)
        if found is not None:
            return DefaultModel(f"{provider}:{DEFAULT_MODELS[provider]}", f"{found} is set")
    return DefaultModel(str(parse_model_spec("scripted")), "no provider key is set")
