"""OpenTelemetry traces: in process with the SDK's in-memory exporter, and one turn's
trace across real gateway, loop-worker and tool-runner processes, received over OTLP/HTTP."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import secrets
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from holdfast_shared.jobs import ToolCallJob, ToolOutcome, TurnJob
from holdfast_shared.logs import JsonFormatter, bind_turn
from holdfast_shared.observability import metrics, tracing
from holdfast_shared.observability.scopes import observed_tool_call, observed_turn, traced
from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    ProviderError,
    TextChunk,
    UsageReport,
)
from holdfast_shared.providers.calls import observed_model_call
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from holdfast.testing.processes import Kind
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute

# Generous: the module's engine starts three processes, on a machine that may be busy.
pytestmark = pytest.mark.timeout(240)
STARTUP_SECONDS = 180


# -- in process ------------------------------------------------------------------------
@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.install(provider)
    try:
        yield memory
    finally:
        tracing.uninstall()
        provider.shutdown()


async def model_stream(*, fail: bool = False) -> AsyncIterator[ModelEvent]:
    yield BlockStart(index=0, block_type="text")
    yield TextChunk(index=0, text="hi")
    if fail:
        raise ProviderError("PROVIDER_ERROR", "the model went away")
    yield BlockStop(index=0)
    yield UsageReport(input_tokens=12, output_tokens=3)
    yield Finish(stop_reason="end_turn")


class Runner:
    """Stands in for the tool-runner's executor: the same decorator on its handle()."""

    @observed_tool_call
    async def handle(self, job: ToolCallJob) -> ToolOutcome:
        return ToolOutcome(output="listed")


def by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


async def test_a_turn_is_one_trace_from_request_to_tool(exporter: InMemorySpanExporter) -> None:
    @traced("holdfast.turn.start")
    async def gateway() -> TurnJob:
        return TurnJob(
            task_id="task_1",
            turn_id="turn_1",
            tenant_id="t",
            traceparent=tracing.turn_traceparent("task_1", "turn_1"),
        )

    job = TurnJob.model_validate_json((await gateway()).model_dump_json())  # as queued
    assert job.traceparent is not None

    async def run() -> str:
        async for _ in observed_model_call("scripted", "echo", model_stream()):
            pass
        call = ToolCallJob(
            tenant_id="t",
            task_id=job.task_id,
            turn_id=job.turn_id,
            tool_call_id="call_1",
            tool="list_dir",
            input={},
            reply_to="inbox",
            traceparent=tracing.current_traceparent(),
        )
        await Runner().handle(ToolCallJob.model_validate_json(call.model_dump_json()))
        return "completed"

    assert await asyncio.create_task(observed_turn(job, run)) == "completed"
    spans = by_name(exporter.get_finished_spans())
    assert set(spans) == {
        "holdfast.turn.start",
        "holdfast.turn",
        "chat echo",
        "execute_tool list_dir",
    }
    request, turn = spans["holdfast.turn.start"], spans["holdfast.turn"]
    chat, tool = spans["chat echo"], spans["execute_tool list_dir"]
    assert len({s.context.trace_id for s in spans.values()}) == 1
    assert request.parent is None
    assert request.attributes == {"holdfast.task_id": "task_1", "holdfast.turn_id": "turn_1"}
    assert turn.parent is not None and turn.parent.span_id == request.context.span_id
    assert chat.parent is not None and chat.parent.span_id == turn.context.span_id
    assert tool.parent is not None and tool.parent.span_id == turn.context.span_id
    assert turn.attributes is not None and turn.attributes["holdfast.outcome"] == "completed"
    # The GenAI semantic conventions.
    assert chat.kind is SpanKind.CLIENT
    assert dict(chat.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": "scripted",
        "gen_ai.provider.name": "scripted",
        "gen_ai.request.model": "echo",
        "gen_ai.usage.input_tokens": 12,
        "gen_ai.usage.output_tokens": 3,
        "gen_ai.response.finish_reasons": ("end_turn",),
    }
    assert tool.attributes is not None and tool.attributes["gen_ai.tool.name"] == "list_dir"


async def test_a_failed_model_call_is_an_error_span(exporter: InMemorySpanExporter) -> None:
    errors = metrics.MODEL_CALL_SECONDS.labels("scripted:broken", "error")._sum.get()
    with pytest.raises(ProviderError):
        async for _ in observed_model_call("scripted", "broken", model_stream(fail=True)):
            pass
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert metrics.MODEL_CALL_SECONDS.labels("scripted:broken", "error")._sum.get() > errors


async def test_a_malformed_traceparent_starts_a_new_trace(
    exporter: InMemorySpanExporter,
) -> None:
    job = TurnJob(task_id="a", turn_id="b", tenant_id="t", traceparent="00-not-a-trace-01")

    async def run() -> str:
        return "errored"

    assert await observed_turn(job, run) == "errored"
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.status.status_code is StatusCode.ERROR


async def test_without_an_endpoint_nothing_is_traced() -> None:
    assert not tracing.configure_tracing("gateway", environ={})
    assert not tracing.enabled()
    assert tracing.current_traceparent() is None
    with tracing.span("nothing") as current:
        assert current is None
    # Jobs queued before the field existed still parse.
    old = TurnJob.model_validate_json('{"task_id":"a","turn_id":"b","tenant_id":"t"}')
    assert old.traceparent is None


def test_json_log_lines_carry_the_turn_ids() -> None:
    formatter = JsonFormatter("loop-worker")

    def line(message: str) -> dict[str, Any]:
        record = logging.LogRecord("holdfast.x", logging.INFO, __file__, 1, message, (), None)
        return dict(json.loads(formatter.format(record)))

    outside = line("before")
    assert "task_id" not in outside and "turn_id" not in outside

    async def in_turn() -> dict[str, Any]:
        bind_turn("task_9", "turn_9")
        return line("multi\nline")

    inside = asyncio.run(in_turn())
    assert inside["task_id"] == "task_9" and inside["turn_id"] == "turn_9"
    assert inside["message"] == "multi\nline" and inside["level"] == "INFO"
    assert inside["service"] == "loop-worker" and inside["logger"] == "holdfast.x"
    assert "task_id" not in line("after")  # the turn's task ended: nothing leaked


# -- across processes ------------------------------------------------------------------
@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class Collector:
    """A minimal OTLP/HTTP trace receiver: what the processes export, decoded."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector.take(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attributes = {
                        a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value")
                        for a in span.attributes
                    }
                    with self.lock:
                        self.spans.append(
                            ReceivedSpan(
                                resource["service.name"],
                                span.name,
                                span.trace_id.hex(),
                                span.span_id.hex(),
                                span.parent_span_id.hex(),
                                attributes,
                            )
                        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    receiver = Collector()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def traced_engine(
    collector: Collector,
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}tracing:",
        HOLDFAST_WORKSPACE_ROOT=str(tmp_path_factory.mktemp("tracing-workspaces")),
        HOLDFAST_EMBEDDER="none",
        OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    with running_engine(
        env, workers=0, gateways=0, directory=tmp_path_factory.mktemp("tracing")
    ) as procs:
        kinds: tuple[Kind, ...] = ("gateway", "loop-worker", "tool-runner")
        for kind in kinds:
            procs.start(kind, wait=False)
        procs.wait_ready(*procs.processes, within=STARTUP_SECONDS)
        yield procs


async def test_one_trace_spans_gateway_worker_and_runner(
    traced_engine: EngineProcesses, collector: Collector, api_keys: dict[str, str]
) -> None:
    message = "/script " + json.dumps(
        {"text": "done", "tool_calls": [{"name": "list_dir", "input": {}}]}
    )
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client,
            traced_engine.url,
            api_keys["main"],
            {"message": message, "task_id": f"traced-{secrets.token_hex(4)}"},
        )
    assert got.status == 200 and got.events[-1]["phase"] == "completed", got.types
    turn_id = got.events[0]["turn_id"]

    def ours() -> list[ReceivedSpan]:
        """Every span of the trace the gateway started for this turn. (A resume job
        queued for it later, e.g. by a sweep, starts a trace of its own.)"""
        with collector.lock:
            started = {
                s.trace_id
                for s in collector.spans
                if s.name == "holdfast.turn.start"
                and s.attributes.get("holdfast.turn_id") == turn_id
            }
            return [s for s in collector.spans if s.trace_id in started]

    wanted = {
        "POST /execute",
        "holdfast.turn.start",
        "holdfast.turn",
        "chat scripted",
        "execute_tool list_dir",
    }
    for _ in range(100):
        spans = ours()
        if wanted <= {s.name for s in spans}:
            break
        await asyncio.sleep(0.1)
    names = sorted(s.name for s in spans)
    assert wanted <= set(names), names
    assert len({s.trace_id for s in spans}) == 1
    ids = {s.span_id: s for s in spans}

    def one(name: str) -> ReceivedSpan:
        (found,) = [s for s in spans if s.name == name]
        return found

    def ancestors(span: ReceivedSpan) -> list[str]:
        chain = []
        while span.parent_id:
            span = ids[span.parent_id]
            chain.append(span.name)
        return chain

    # The root: FastAPI's own server span of the request (it traces through the
    # provider the gateway installed); the turn's start inside it.
    request = one("POST /execute")
    assert request.service == "holdfast-gateway" and request.parent_id == ""
    assert request.attributes["http.route"] == "/execute"
    start = one("holdfast.turn.start")
    assert start.service == "holdfast-gateway" and "POST /execute" in ancestors(start)
    turn = one("holdfast.turn")
    assert turn.service == "holdfast-loop-worker" and turn.parent_id == start.span_id
    tool = one("execute_tool list_dir")
    assert tool.service == "holdfast-tool-runner" and tool.parent_id == turn.span_id
    # Two model calls (asking for the tool, then answering), each with its usage.
    chats = [s for s in spans if s.name == "chat scripted"]
    assert len(chats) == 2
    for chat in chats:
        assert chat.service == "holdfast-loop-worker" and chat.parent_id == turn.span_id
        assert chat.attributes["gen_ai.system"] == "scripted"
        assert chat.attributes["gen_ai.request.model"] == "scripted"
        assert chat.attributes["gen_ai.usage.output_tokens"] > 0
    reasons = sorted(str(chat.attributes["gen_ai.response.finish_reasons"]) for chat in chats)
    assert "tool_use" in reasons[1] and "end_turn" in reasons[0], reasons
