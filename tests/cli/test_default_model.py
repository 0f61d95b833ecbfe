"""The default model ``holdfast up`` names in its start banner is the one the
loop-workers answer with, and with no key the banner says it echoes and how to
set a real one (issue #25, 2: it was said nowhere a newcomer looks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from holdfast_shared.providers.registry import ProviderRegistry
from holdfast_shared.settings import Settings
from rich.console import Console

from holdfast.defaultmodel import PROVIDER_VARIABLES, default_model
from holdfast.supervisor import _banner, _Child

ENVIRONS: list[tuple[str | None, dict[str, str]]] = [
    (None, {}),
    (None, {"ANTHROPIC_API_KEY": "k"}),
    (None, {"OPENAI_API_KEY": "k", "GEMINI_API_KEY": "k"}),
    (None, {"OPENAI_BASE_URL": "http://127.0.0.1:11434/v1"}),
    (None, {"GOOGLE_API_KEY": "k"}),
    (None, {"ANTHROPIC_API_KEY": "", "GEMINI_API_KEY": "k"}),
    ("scripted", {"ANTHROPIC_API_KEY": "k"}),
    ("openai:llama3.1", {"OPENAI_BASE_URL": "http://127.0.0.1:11434/v1"}),
    ("anthropic", {"ANTHROPIC_API_KEY": "k"}),
]


@pytest.mark.parametrize(("configured", "environ"), ENVIRONS)
async def test_the_banner_names_the_model_the_workers_choose(
    configured: str | None, environ: dict[str, str]
) -> None:
    registry = ProviderRegistry.from_env(environ, configured)
    try:
        chosen = registry.resolve(None)
        expected = f"{chosen.provider.name}:{chosen.model}"
    finally:
        await registry.aclose()
    assert default_model(configured, environ).spec == expected


def banner_text(tmp_path: Path, settings: Settings) -> str:
    console = Console(record=True, width=200)
    console.print(
        _banner(
            settings,
            data_dir=tmp_path,
            redis=("embedded", "redis://x"),
            postgres=("embedded", "postgresql://x"),
            key_where="here",
            children=[_Child("loop-worker", "loop-worker", "green")],
        )
    )
    return " ".join(console.export_text().split())


def test_with_no_key_the_banner_says_the_model_echoes_and_how_to_set_a_real_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in (v for variables in PROVIDER_VARIABLES.values() for v in variables):
        monkeypatch.delenv(variable, raising=False)
    text = banner_text(tmp_path, Settings(model=None))
    assert "scripted:scripted (no provider key is set)" in text, text
    assert "echoes" in text and "/script" in text, text
    for how in ("ANTHROPIC_API_KEY", "HOLDFAST_MODEL=", "OPENAI_BASE_URL="):
        assert how in text, text


def test_with_a_key_the_banner_names_the_real_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in (v for variables in PROVIDER_VARIABLES.values() for v in variables):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("GEMINI_API_KEY", "k")
    text = banner_text(tmp_path, Settings(model=None))
    assert "gemini:gemini-2.5-flash (GEMINI_API_KEY is set)" in text, text
    assert "echoes" not in text, text
