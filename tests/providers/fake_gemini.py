"""Replies in the Gemini API's streaming wire format, for a :class:`WireServer`.

``streamGenerateContent?alt=sse`` answers data-only SSE: every event is a
whole ``GenerateContentResponse`` holding the next slice of
``candidates[0].content.parts``. Every chunk carries ``usageMetadata`` as a
running total (prompt counts from the start, output counts on the last one);
the last chunk adds ``finishReason``. Thought summaries are text parts with
``"thought": true``; a ``thoughtSignature`` (base64) rides on the part it
signs, for text often on a final part with empty text. Function calls arrive
whole (``args`` complete in one part): the Gemini API does not stream call
arguments, so there are no fragments to split.

Errors are JSON bodies ``{"error": {"code", "message", "status", "details"?}}``;
Gemini puts a rate limit's wait in a ``google.rpc.RetryInfo`` detail (a
``retry-after`` header is optional here, as proxies add one). A failure after
the stream started is an ``{"error": ...}`` data event.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from tests.providers.wire import SSE, Recorded, Reply, Responder

MODEL = "gemini-2.5-flash"
RESPONSE_ID = "qSwBaf2vLo3Uz7IPmqjB8Qk"
SIGNATURE = "CiQB0e2Kb7k3N2o1c2lnbmVkLXRob3VnaHQtc3RhdGU="


def usage(prompt: int, output: int = 0, *, cached: int = 0, thoughts: int = 0) -> dict[str, Any]:
    """``usageMetadata`` as Gemini reports it; cached tokens are inside ``prompt``."""
    meta: dict[str, Any] = {
        "promptTokenCount": prompt,
        "totalTokenCount": prompt + output + thoughts,
        "promptTokensDetails": [{"modality": "TEXT", "tokenCount": prompt}],
    }
    if output:
        meta["candidatesTokenCount"] = output
    if cached:
        meta["cachedContentTokenCount"] = cached
        meta["cacheTokensDetails"] = [{"modality": "TEXT", "tokenCount": cached}]
    if thoughts:
        meta["thoughtsTokenCount"] = thoughts
    return meta


def chunk(
    parts: list[dict[str, Any]],
    usage_metadata: dict[str, Any],
    *,
    finish_reason: str | None = None,
) -> SSE:
    candidate: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": 0}
    if finish_reason is not None:
        candidate["finishReason"] = finish_reason
    return SSE(
        {
            "candidates": [candidate],
            "usageMetadata": usage_metadata,
            "modelVersion": MODEL,
            "responseId": RESPONSE_ID,
        }
    )


def text_reply(
    deltas: list[str],
    *,
    prompt: int = 12,
    output: int = 9,
    cached: int = 0,
    finish_reason: str = "STOP",
) -> Reply:
    """A plain answer, one text part per delta."""
    running = usage(prompt, cached=cached)
    events = [chunk([{"text": d}], running) for d in deltas[:-1]]
    events.append(
        chunk(
            [{"text": deltas[-1]}],
            usage(prompt, output, cached=cached),
            finish_reason=finish_reason,
        )
    )
    return Reply(events=events)


def thinking_reply(
    thoughts: list[str],
    deltas: list[str],
    *,
    signature: str = SIGNATURE,
    prompt: int = 20,
    output: int = 7,
    thought_tokens: int = 31,
) -> Reply:
    """Thought summaries, then the answer; the signature on a last empty text part."""
    running = usage(prompt, thoughts=thought_tokens)
    events = [chunk([{"text": t, "thought": True}], running) for t in thoughts]
    events += [chunk([{"text": d}], running) for d in deltas]
    events.append(
        chunk(
            [{"text": "", "thoughtSignature": signature}],
            usage(prompt, output, thoughts=thought_tokens),
            finish_reason="STOP",
        )
    )
    return Reply(events=events)


def tool_call_reply(
    name: str,
    args: dict[str, Any],
    *,
    call_id: str | None = None,
    thoughts: Sequence[str] = (),
    text: str | None = None,
    signature: str | None = SIGNATURE,
    prompt: int = 40,
    output: int = 15,
    thought_tokens: int = 0,
) -> Reply:
    """Optional thoughts and text, then one whole ``functionCall`` part (signed)."""
    running = usage(prompt, thoughts=thought_tokens)
    events = [chunk([{"text": t, "thought": True}], running) for t in thoughts]
    if text is not None:
        events.append(chunk([{"text": text}], running))
    call: dict[str, Any] = {"name": name, "args": args}
    if call_id is not None:
        call["id"] = call_id
    part: dict[str, Any] = {"functionCall": call}
    if signature is not None:
        part["thoughtSignature"] = signature
    events.append(
        chunk([part], usage(prompt, output, thoughts=thought_tokens), finish_reason="STOP")
    )
    return Reply(events=events)


def parallel_calls_reply(
    calls: list[tuple[str, dict[str, Any]]], *, signature: str = SIGNATURE
) -> Reply:
    """Several calls in one part list; only the first one is signed, as Gemini does."""
    parts: list[dict[str, Any]] = []
    for i, (name, args) in enumerate(calls):
        part: dict[str, Any] = {"functionCall": {"name": name, "args": args}}
        if i == 0:
            part["thoughtSignature"] = signature
        parts.append(part)
    return Reply(events=[chunk(parts, usage(30, 20), finish_reason="STOP")])


def blocked_prompt(reason: str = "PROHIBITED_CONTENT") -> Reply:
    """The prompt itself refused: ``promptFeedback`` and no candidate."""
    return Reply(
        events=[
            SSE(
                {
                    "promptFeedback": {"blockReason": reason},
                    "usageMetadata": usage(8),
                    "modelVersion": MODEL,
                    "responseId": RESPONSE_ID,
                }
            )
        ]
    )


# --- embeddings ----------------------------------------------------------------

EMBEDDING_MODEL = "gemini-embedding-001"
EMBEDDING_DIMS = 3072
# The most requests one batchEmbedContents may carry.
MAX_BATCH_EMBED = 100
_EMBED_PATH = re.compile(r"/v1(?:beta)?/(models/[^/:]+):(batchEmbedContents|embedContent)$")


def _text_of(content: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for part in content.get("parts") or [])


def embeddings(vector_of: Callable[[str, str | None], Sequence[float]]) -> Responder:
    """``:batchEmbedContents`` and ``:embedContent`` answered as the Gemini API does.

    A batch (what google-genai sends for ``models.embed_content`` on the
    Gemini API, whatever the number of contents) is ``{"requests": [{"model":
    "models/...", "content": {"parts": [{"text"}], "role"}, "taskType"?,
    "outputDimensionality"?}]}`` and is answered ``{"embeddings": [{"values":
    [...]}]}`` in order; a single ``embedContent`` is ``{"content", ...}``
    answered ``{"embedding": {"values"}}``. ``outputDimensionality`` keeps the
    first values without scaling them back to unit length (gemini-embedding-001
    leaves that to the caller). ``vector_of(text, task_type)`` is the "model",
    so a test can tell a query's vector from a document's.
    """

    def one(request: dict[str, Any]) -> dict[str, Any]:
        values = list(vector_of(_text_of(request["content"]), request.get("taskType")))
        wanted = request.get("outputDimensionality")
        return {"values": values[:wanted] if wanted else values}

    def answer(recorded: Recorded) -> Reply:
        body = recorded.json
        if recorded.path.endswith(":batchEmbedContents"):
            return Reply(body={"embeddings": [one(r) for r in body["requests"]]})
        return Reply(body={"embedding": one(body)})

    return answer


def _refuse_embeddings(path_model: str, body: Any) -> Reply | None:
    requests = body.get("requests")
    if requests is None:
        requests = [body]
    elif len(requests) > MAX_BATCH_EMBED:
        return _invalid(
            f"* BatchEmbedContentsRequest.requests: at most {MAX_BATCH_EMBED} requests "
            "can be in one batch\n"
        )
    for n, request in enumerate(requests):
        if "model" in request and request["model"] != path_model:
            return _invalid(
                f"Model names should match the model name in the URL. "
                f"requests[{n}].model: {request['model']}, URL: {path_model}"
            )
        if not _text_of(request.get("content") or {}).strip():
            return _invalid(f"* BatchEmbedContentsRequest.requests[{n}].content: required\n")
    return None


def _error(
    code: int, status: str, message: str, details: list[Any] | None = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message, "status": status}
    if details:
        error["details"] = details
    return {"error": error}


def rate_limited(*, retry_after: str | None = "1", retry_delay: str | None = None) -> Reply:
    """429 RESOURCE_EXHAUSTED; ``retry_delay`` (e.g. ``"1.5s"``) adds a RetryInfo."""
    details: list[Any] = [
        {
            "@type": "type.googleapis.com/google.rpc.QuotaFailure",
            "violations": [
                {
                    "quotaMetric": (
                        "generativelanguage.googleapis.com/generate_content_free_tier_requests"
                    ),
                    "quotaId": "GenerateRequestsPerMinutePerProjectPerModel-FreeTier",
                    "quotaDimensions": {"location": "global", "model": MODEL},
                    "quotaValue": "10",
                }
            ],
        }
    ]
    if retry_delay is not None:
        details.append(
            {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": retry_delay}
        )
    body = _error(
        429,
        "RESOURCE_EXHAUSTED",
        "You exceeded your current quota, please check your plan and billing details.",
        details,
    )
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return Reply(status=429, body=body, headers=headers)


def server_error() -> Reply:
    return Reply(
        status=500,
        body=_error(
            500,
            "INTERNAL",
            "An internal error has occurred. Please retry or report in "
            "https://developers.generativeai.google/guide/troubleshooting",
        ),
    )


def overloaded() -> Reply:
    """Gemini's "overloaded" is a 503 UNAVAILABLE (there is no 529)."""
    return Reply(
        status=503,
        body=_error(503, "UNAVAILABLE", "The model is overloaded. Please try again later."),
    )


def context_overflow(tokens: int = 1_200_293, limit: int = 1_048_576) -> Reply:
    message = (
        f"The input token count ({tokens}) exceeds the maximum number of tokens allowed ({limit})."
    )
    return Reply(status=400, body=_error(400, "INVALID_ARGUMENT", message))


def error_mid_stream(deltas: list[str]) -> Reply:
    """Text deltas, then an ``{"error": ...}`` event inside the 200 stream."""
    events = [chunk([{"text": d}], usage(12)) for d in deltas]
    events.append(SSE(_error(500, "INTERNAL", "An internal error has occurred.")))
    return Reply(events=events)


def dropped_mid_stream(deltas: list[str]) -> Reply:
    """Text deltas, then the connection resets before the final chunk."""
    reply = text_reply([*deltas, "never sent"])
    reply.break_after = len(deltas)
    return reply


def cut_short(deltas: list[str]) -> Reply:
    """A clean end of stream that never sent a ``finishReason``."""
    return Reply(events=[chunk([{"text": d}], usage(12)) for d in deltas])


# --- request checks: what the real API refuses with a 400 -------------------


def refuse(request: Recorded) -> Reply | None:
    """The 400 ``generateContent`` answers to this request, or None.

    As Gemini checks it: a function call turn comes right after a user turn
    or a function response turn, is followed by a turn of as many function
    responses, and a function response turn comes right after a function
    call turn. An embedding request names the URL's model in each of its
    requests, has text to embed, and batches at most 100.
    """
    if not isinstance(request.json, dict):
        return None
    embed = _EMBED_PATH.search(request.path)
    if embed is not None:
        return _refuse_embeddings(embed.group(1), request.json)
    if ":streamGenerateContent" not in request.path and ":generateContent" not in request.path:
        return None
    contents = request.json.get("contents") or []
    previous_calls = 0
    for n, content in enumerate(contents):
        parts = content.get("parts") or []
        calls = sum(1 for p in parts if "functionCall" in p or "function_call" in p)
        responses = sum(1 for p in parts if "functionResponse" in p or "function_response" in p)
        if previous_calls and responses != previous_calls:
            return _invalid(
                "Please ensure that the number of function response parts is equal to the "
                "number of function call parts of the function call turn."
            )
        if responses and not previous_calls:
            return _invalid(
                "Please ensure that function response turn comes immediately after a function "
                "call turn."
            )
        if calls and n > 0 and contents[n - 1].get("role") == "model":
            return _invalid(
                "Please ensure that function call turn comes immediately after a user turn or "
                "after a function response turn."
            )
        previous_calls = calls if content.get("role") == "model" else 0
    if previous_calls:
        return _invalid(
            "Please ensure that the number of function response parts is equal to the "
            "number of function call parts of the function call turn."
        )
    return None


def _invalid(message: str) -> Reply:
    return Reply(status=400, body=_error(400, "INVALID_ARGUMENT", message))
