"""Embedders: the local ones' properties, and the OpenAI and Gemini ones through
their real SDKs against local servers speaking each API's wire format."""

from __future__ import annotations

import base64
import hashlib
import math
import os
import random
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
from google import genai
from google.genai import types
from holdfast_shared.errors import ErrorCode
from holdfast_shared.memory.embedders import (
    SETTING_PATTERN,
    EmbeddingError,
    GeminiEmbedder,
    HashingEmbedder,
    OpenAIEmbedder,
    WordLlamaEmbedder,
    from_settings,
)
from holdfast_shared.settings import Settings
from openai import AsyncOpenAI

from bench.recall_set import corpus, questions
from tests.providers import fake_gemini, fake_openai
from tests.providers.wire import Recorded, Reply, WireServer

pytestmark = pytest.mark.timeout(60)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def norm(vector: Sequence[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def model_vector(text: str, dims: int) -> list[float]:
    """What the fake servers' "model" answers: a dense unit vector drawn from
    the text, so a test knows exactly which vector each text comes back with."""
    draw = random.Random(hashlib.sha256(text.encode()).digest())
    vector = [draw.gauss(0.0, 1.0) for _ in range(dims)]
    length = norm(vector)
    return [x / length for x in vector]


@pytest.fixture(scope="module")
def server() -> Iterator[WireServer]:
    wire = WireServer((fake_openai.refuse, fake_gemini.refuse)).start()
    yield wire
    wire.stop()


@pytest.fixture
def wire(server: WireServer) -> WireServer:
    server.replies.clear()
    server.requests.clear()
    return server


@pytest.fixture(scope="module")
def wordllama() -> WordLlamaEmbedder:
    return WordLlamaEmbedder()


# --- hashing ------------------------------------------------------------------------


def test_hashing_is_deterministic_across_instances_and_processes() -> None:
    text = "My sister Anna lives in Lisbon and works at a bank."
    first = HashingEmbedder().embed_one(text)
    assert HashingEmbedder().embed_one(text) == first
    # Another process with another str hash seed: nothing depends on hash().
    script = (
        "from holdfast_shared.memory.embedders import HashingEmbedder\n"
        f"print(repr(HashingEmbedder().embed_one({text!r})))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert [round(x, 12) for x in eval(out.stdout)] == [round(x, 12) for x in first]


def test_hashing_vectors_are_unit_length_of_the_configured_size() -> None:
    for dims in (64, 384, 1024):
        embedder = HashingEmbedder(dims)
        assert embedder.dims == dims and embedder.name == f"hashing-v1-{dims}"
        vector = embedder.embed_one("The staging server runs Ubuntu 22.04.")
        assert len(vector) == dims
        assert norm(vector) == pytest.approx(1.0)


def test_hashing_nothing_to_embed_is_the_zero_vector() -> None:
    embedder = HashingEmbedder()
    for text in ("", "   ", "what is it that I am?", "!!!"):
        assert embedder.embed_one(text) == [0.0] * embedder.dims


def test_hashing_similar_texts_are_closer_than_unrelated_ones() -> None:
    embedder = HashingEmbedder()
    fact, paraphrase, unrelated = embedder.embed_sync(
        [
            "My dog is called Rex.",
            "What's the name of my dog Rex?",
            "The staging server runs Ubuntu 22.04.",
        ]
    )
    assert cosine(fact, paraphrase) > cosine(fact, unrelated) + 0.3
    # Word pieces: other forms and spellings of a word still meet.
    allergic, allergies, colour, color = embedder.embed_sync(
        ["I'm allergic to peanuts.", "Any allergies?", "favourite colour", "favorite color"]
    )
    assert cosine(allergic, allergies) > cosine(allergic, colour) + 0.15
    assert cosine(colour, color) > cosine(colour, unrelated) + 0.15


async def test_hashing_bulk_embedding_gives_the_same_vectors() -> None:
    embedder = HashingEmbedder()
    texts = corpus()
    assert await embedder.embed(texts) == embedder.embed_sync(texts)


# --- WordLlama ----------------------------------------------------------------------


def test_wordllama_reads_its_bundled_files(wordllama: WordLlamaEmbedder) -> None:
    assert wordllama.name == "wordllama-l2_supercat-256"
    assert wordllama.dims == 256
    vectors = wordllama.embed_sync(["My dog is called Rex.", ""])
    assert norm(vectors[0]) == pytest.approx(1.0)
    assert vectors[1] == [0.0] * 256
    assert wordllama.embed_sync(["My dog is called Rex."]) == vectors[:1]


def test_wordllama_knows_meanings_hashing_cannot(wordllama: WordLlamaEmbedder) -> None:
    milk, lactose, server, boss, manager, dog = wordllama.embed_sync(
        [
            "Can I drink milk?",
            "I'm lactose intolerant.",
            "The staging server runs Ubuntu 22.04.",
            "Who is my boss?",
            "My manager is called Priya Shah.",
            "My dog is called Rex.",
        ]
    )
    # Not a word in common, yet these are near each other.
    assert cosine(milk, lactose) > cosine(milk, server) + 0.2
    assert cosine(boss, manager) > cosine(boss, dog)


async def test_wordllama_finds_paraphrased_facts(wordllama: WordLlamaEmbedder) -> None:
    # The figure the module docstring gives for the default (bench/embedders.py).
    docs = await wordllama.embed(corpus())
    hits = 0
    for i, query in enumerate(await wordllama.embed(questions(), purpose="query")):
        ranked = sorted(range(len(docs)), key=lambda j: -cosine(query, docs[j]))
        hits += i in ranked[:5]
    assert hits / len(questions()) >= 0.9


# --- OpenAI -------------------------------------------------------------------------


@pytest.fixture
async def openai_embedder(wire: WireServer) -> AsyncIterator[OpenAIEmbedder]:
    embedder = OpenAIEmbedder(api_key="sk-test", base_url=f"{wire.url}/v1")
    yield embedder
    await embedder.aclose()


async def test_openai_embeds_through_the_sdk(
    wire: WireServer, openai_embedder: OpenAIEmbedder
) -> None:
    wire.queue(fake_openai.embeddings(model_vector))
    texts = ["My dog is called Rex.", "I work as a nurse."]
    vectors = await openai_embedder.embed(texts)
    assert openai_embedder.name == "openai:text-embedding-3-small"
    assert openai_embedder.dims == 1536
    for text, vector in zip(texts, vectors, strict=True):
        # float32 on the wire, base64-encoded: equal to float32 precision.
        assert vector == pytest.approx(model_vector(text, 1536), abs=1e-6)
        assert norm(vector) == pytest.approx(1.0)
    (request,) = wire.requests
    assert request.path == "/v1/embeddings"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.json == {
        "model": "text-embedding-3-small",
        "input": texts,
        "encoding_format": "base64",
    }


def test_the_fake_encodes_base64_as_openai_does() -> None:
    body = {"model": "text-embedding-3-small", "input": ["a"], "encoding_format": "base64"}
    reply = fake_openai.embeddings(lambda text, dims: [3.0, 4.0])(
        Recorded("POST", "/v1/embeddings", "", {}, body)
    )
    packed = base64.b64decode(reply.body["data"][0]["embedding"])
    assert struct.unpack("<2f", packed) == pytest.approx((0.6, 0.8))
    assert reply.body["object"] == "list" and reply.body["data"][0]["object"] == "embedding"


async def test_openai_batches_and_skips_empty_texts(
    wire: WireServer, openai_embedder: OpenAIEmbedder
) -> None:
    texts = [f"fact number {i}" for i in range(300)]
    texts[7] = ""  # the API refuses an empty input: it is not sent
    wire.queue(fake_openai.embeddings(model_vector), fake_openai.embeddings(model_vector))
    vectors = await openai_embedder.embed(texts)
    assert [len(r.json["input"]) for r in wire.requests] == [256, 43]
    assert vectors[7] == [0.0] * 1536
    assert vectors[299] == pytest.approx(model_vector("fact number 299", 1536), abs=1e-6)


async def test_openai_asks_for_the_configured_size(wire: WireServer) -> None:
    embedder = OpenAIEmbedder(
        "text-embedding-3-large", api_key="sk-test", base_url=f"{wire.url}/v1", dims=256
    )
    try:
        wire.queue(fake_openai.embeddings(model_vector))
        (vector,) = await embedder.embed(["hello"])
    finally:
        await embedder.aclose()
    assert embedder.name == "openai:text-embedding-3-large@256"
    assert wire.requests[0].json["dimensions"] == 256
    assert len(vector) == 256 and norm(vector) == pytest.approx(1.0)


async def test_openai_errors_become_embedding_errors(wire: WireServer) -> None:
    client = AsyncOpenAI(api_key="sk-test", base_url=f"{wire.url}/v1", max_retries=0)
    embedder = OpenAIEmbedder(api_key="sk-test", client=client)
    try:
        wire.queue(fake_openai.rate_limited())
        with pytest.raises(EmbeddingError) as limited:
            await embedder.embed(["hello"])
        assert limited.value.code == ErrorCode.LLM_RATE_LIMITED
        wire.queue(fake_openai.server_error())
        with pytest.raises(EmbeddingError) as failed:
            await embedder.embed(["hello"])
        assert failed.value.code == ErrorCode.LLM_PROVIDER_ERROR
        # A server whose vectors are not the size the model should have.
        short = {"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}
        wire.queue(
            Reply(
                body={
                    "object": "list",
                    "data": [short],
                    "model": "text-embedding-3-small",
                    "usage": {"prompt_tokens": 1, "total_tokens": 1},
                }
            )
        )
        with pytest.raises(EmbeddingError, match="2 dimensions, expected 1536"):
            await embedder.embed(["hello"])
    finally:
        await embedder.aclose()


# --- Gemini -------------------------------------------------------------------------


def gemini_vector(text: str, task_type: str | None) -> list[float]:
    # Unnormalised, as gemini-embedding-001's shortened vectors are; the task
    # type shifts the vector so a test can tell which one was asked for.
    vector = [x * 3.0 for x in model_vector(text, fake_gemini.EMBEDDING_DIMS)]
    if task_type == "RETRIEVAL_QUERY":
        vector[0] += 1.0
    return vector


@pytest.fixture
async def gemini_embedder(wire: WireServer) -> AsyncIterator[GeminiEmbedder]:
    embedder = GeminiEmbedder(api_key="AIzaTest", base_url=wire.url)
    yield embedder
    await embedder.aclose()


async def test_gemini_embeds_through_the_sdk(
    wire: WireServer, gemini_embedder: GeminiEmbedder
) -> None:
    wire.queue(fake_gemini.embeddings(gemini_vector))
    texts = ["My dog is called Rex.", "I work as a nurse."]
    vectors = await gemini_embedder.embed(texts)
    assert gemini_embedder.name == "gemini:gemini-embedding-001"
    assert gemini_embedder.dims == 3072
    for text, vector in zip(texts, vectors, strict=True):
        assert vector == pytest.approx(model_vector(text, 3072), abs=1e-9)
    (request,) = wire.requests
    assert request.path == "/v1beta/models/gemini-embedding-001:batchEmbedContents"
    assert request.headers["x-goog-api-key"] == "AIzaTest"
    assert request.json == {
        "requests": [
            {
                "content": {"parts": [{"text": text}], "role": "user"},
                "taskType": "RETRIEVAL_DOCUMENT",
                "model": "models/gemini-embedding-001",
            }
            for text in texts
        ]
    }


async def test_gemini_queries_and_shorter_vectors(wire: WireServer) -> None:
    embedder = GeminiEmbedder(api_key="AIzaTest", base_url=wire.url, dims=768)
    try:
        wire.queue(fake_gemini.embeddings(gemini_vector))
        (vector,) = await embedder.embed(["Who is my boss?"], purpose="query")
    finally:
        await embedder.aclose()
    (request,) = wire.requests[0].json["requests"]
    assert request["taskType"] == "RETRIEVAL_QUERY"
    assert request["outputDimensionality"] == 768
    assert embedder.name == "gemini:gemini-embedding-001@768"
    # The API leaves shortened vectors unnormalised; the embedder normalises them.
    assert len(vector) == 768 and norm(vector) == pytest.approx(1.0)


async def test_gemini_batches_by_a_hundred(
    wire: WireServer, gemini_embedder: GeminiEmbedder
) -> None:
    texts = [f"fact number {i}" for i in range(250)]
    wire.queue(*(fake_gemini.embeddings(gemini_vector) for _ in range(3)))
    vectors = await gemini_embedder.embed(texts)
    assert [len(r.json["requests"]) for r in wire.requests] == [100, 100, 50]
    assert vectors[249] == pytest.approx(model_vector("fact number 249", 3072), abs=1e-9)


async def test_gemini_errors_become_embedding_errors(wire: WireServer) -> None:
    client = genai.Client(
        api_key="AIzaTest",
        http_options=types.HttpOptions(
            base_url=wire.url,
            api_version="v1beta",
            retry_options=types.HttpRetryOptions(attempts=1),
        ),
    )
    embedder = GeminiEmbedder(api_key="AIzaTest", client=client)
    try:
        wire.queue(fake_gemini.rate_limited())
        with pytest.raises(EmbeddingError) as limited:
            await embedder.embed(["hello"])
        assert limited.value.code == ErrorCode.LLM_RATE_LIMITED
        wire.queue(fake_gemini.server_error())
        with pytest.raises(EmbeddingError) as failed:
            await embedder.embed(["hello"])
        assert failed.value.code == ErrorCode.LLM_PROVIDER_ERROR
    finally:
        await embedder.aclose()


# --- configuration ------------------------------------------------------------------


def test_the_setting_and_the_parser_accept_the_same_values() -> None:
    assert Settings.model_fields["embedder"].metadata[0].pattern == SETTING_PATTERN
    assert Settings().embedder == "wordllama"
    for bad in ("bogus", "openai:", "hashing@", "openai:m@x", "gemini:a b"):
        with pytest.raises(ValueError):
            Settings(embedder=bad)


def test_from_settings_builds_the_local_embedders() -> None:
    assert from_settings(Settings(embedder="none"), {}) is None
    default = from_settings(Settings(), {})
    assert isinstance(default, WordLlamaEmbedder)
    hashing = from_settings(Settings(embedder="hashing@128"), {})
    assert isinstance(hashing, HashingEmbedder) and hashing.dims == 128


async def test_from_settings_reads_the_providers_environment(wire: WireServer) -> None:
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        from_settings(Settings(embedder="openai:text-embedding-3-small"), {})
    with pytest.raises(ValueError, match="@<dims>"):
        from_settings(Settings(embedder="openai:nomic-embed-text"), {"OPENAI_API_KEY": "k"})
    with pytest.raises(ValueError, match="GEMINI_API_KEY"):
        from_settings(Settings(embedder="gemini:gemini-embedding-001"), {})

    # A local OpenAI-compatible server: the base URL alone is enough.
    local = from_settings(
        Settings(embedder="openai:nomic-embed-text@768"), {"OPENAI_BASE_URL": f"{wire.url}/v1"}
    )
    gemini = from_settings(
        Settings(embedder="gemini:gemini-embedding-001"),
        {"GEMINI_API_KEY": "AIzaEnv", "HOLDFAST_GEMINI_BASE_URL": wire.url},
    )
    assert isinstance(local, OpenAIEmbedder) and isinstance(gemini, GeminiEmbedder)
    try:
        wire.queue(fake_openai.embeddings(model_vector), fake_gemini.embeddings(gemini_vector))
        (local_vector,) = await local.embed(["hi"])
        (gemini_vector_,) = await gemini.embed(["hi"])
    finally:
        await local.aclose()
        await gemini.aclose()
    assert local.dims == 768 and len(local_vector) == 768
    assert len(gemini_vector_) == 3072
    openai_request, gemini_request = wire.requests
    assert openai_request.headers["authorization"] == "Bearer unused"
    assert openai_request.json["dimensions"] == 768
    assert gemini_request.headers["x-goog-api-key"] == "AIzaEnv"
