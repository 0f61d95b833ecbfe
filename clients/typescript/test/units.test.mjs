// What needs no engine: SSE framing, the transcript, the resume rules, CJS.
import assert from "node:assert/strict";
import { createRequire } from "node:module";
import { test } from "node:test";

import { EVENT_TYPES, FrameDecoder, HoldfastError, TurnText, executeBody } from "../dist/esm/index.js";

const encode = (text) => new TextEncoder().encode(text);

test("frames follow the SSE rules across chunks", () => {
  const decoder = new FrameDecoder();
  const wire = "event: text_delta\r\nid: 7\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n: comment\n\nretry: 250\n\ndata: é";
  const frames = [];
  for (let i = 0; i < wire.length; i += 3) frames.push(...decoder.feed(encode(wire.slice(i, i + 3))));
  frames.push(...decoder.feed(encode("\n\n")));
  assert.deepEqual(frames, [
    { event: "text_delta", data: '{"a":\n1}', id: "7", retry: null },
    { event: "message", data: "", id: null, retry: 250 },
    { event: "message", data: "é", id: null, retry: null },
  ]);
});

test("the transcript drops the range a turn_resumed takes back", () => {
  const text = new TurnText();
  const delta = (seq, t) => ({ type: "text_delta", seq, text: t, task_id: "t", turn_id: "u", timestamp: seq });
  text.feed(delta(3, "par"));
  text.feed(delta(4, "tial"));
  const gone = text.feed({ type: "turn_resumed", seq: 5, reason: "model_retry", discard_from_seq: 3, discard_to_seq: 4 });
  text.feed(delta(6, "whole"));
  assert.deepEqual(gone, [3, 4]);
  assert.equal(text.text, "whole");
  assert.deepEqual([...text.discarded], [3, 4]);
});

test("stream options become POST /execute's body", () => {
  assert.deepEqual(executeBody({ message: "hi", taskId: "t-1", onBusy: "steer", retryMessageId: undefined }), {
    message: "hi",
    task_id: "t-1",
    on_busy: "steer",
  });
});

test("the CommonJS build loads with require", () => {
  const require = createRequire(import.meta.url);
  const cjs = require("../dist/cjs/index.js");
  assert.equal(typeof cjs.HoldfastClient, "function");
  assert.deepEqual(cjs.EVENT_TYPES, EVENT_TYPES);
  assert.ok(new cjs.HoldfastError(400, "X", "m") instanceof Error);
  assert.ok(new HoldfastError(400, "X", "m").toString().includes("400 X: m"));
});

test("a silent connection is dropped and the turn resumed after the last seq", async () => {
  const { createServer } = await import("node:http");
  const { HoldfastClient } = await import("../dist/esm/index.js");
  const frame = (seq, body) =>
    `event: ${body.type}\nid: ${seq}\ndata: ${JSON.stringify({ task_id: "t-1", turn_id: "turn-1", seq, timestamp: seq, ...body })}\n\n`;
  const started = frame(1, { type: "thread_lifecycle", phase: "started" });
  const first = frame(2, { type: "text_delta", text: "a" });
  const rest = frame(3, { type: "text_delta", text: "b" }) + frame(4, { type: "thread_lifecycle", phase: "completed" });
  const requests = [];
  const server = createServer((request, response) => {
    requests.push(`${request.method} ${request.url} ${request.headers["last-event-id"] ?? "-"}`);
    response.writeHead(200, { "Content-Type": "text/event-stream", "X-Task-Id": "t-1", "X-Turn-Id": "turn-1" });
    if (request.method === "POST") response.write(started + first); // then silence
    // A replay that repeats what was delivered is harmless: seqs are checked.
    else response.end(": comment\n\n" + started + first + rest);
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  try {
    const client = new HoldfastClient({
      baseUrl: `http://127.0.0.1:${server.address().port}`,
      apiKey: "k",
      streamReadTimeoutMs: 200,
      reconnect: { delayMs: 10 },
    });
    const turn = client.stream({ message: "hi" });
    const seqs = [];
    for await (const event of turn) seqs.push(event.seq);
    assert.deepEqual(seqs, [1, 2, 3, 4]);
    assert.equal(turn.transcript.text, "ab");
    assert.deepEqual(requests, ["POST /execute -", "GET /execute/replay?task_id=t-1 2"]);
  } finally {
    server.closeAllConnections();
    server.close();
  }
});

test("a POST whose answer was lost is sent again with its Idempotency-Key", async () => {
  const { createServer } = await import("node:http");
  const { HoldfastClient } = await import("../dist/esm/index.js");
  const frame = (seq, body) =>
    `event: ${body.type}\nid: ${seq}\ndata: ${JSON.stringify({ task_id: "t-1", turn_id: "turn-1", seq, timestamp: seq, ...body })}\n\n`;
  const keys = [];
  const server = createServer((request, response) => {
    keys.push(request.headers["idempotency-key"]);
    if (keys.length === 1) {
      request.socket.destroy(); // the engine got it; the client hears nothing
      return;
    }
    response.writeHead(200, { "Content-Type": "text/event-stream", "X-Task-Id": "t-1", "X-Turn-Id": "turn-1" });
    response.end(frame(1, { type: "thread_lifecycle", phase: "started" }) + frame(2, { type: "thread_lifecycle", phase: "completed" }));
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  try {
    const client = new HoldfastClient({
      baseUrl: `http://127.0.0.1:${server.address().port}`,
      apiKey: "k",
      reconnect: { delayMs: 10 },
    });
    const seqs = [];
    for await (const event of client.stream({ message: "hi" })) seqs.push(event.seq);
    assert.deepEqual(seqs, [1, 2]);
    assert.equal(keys.length, 2);
    assert.match(keys[0], /^[0-9a-f-]{36}$/);
    assert.equal(keys[1], keys[0]);
    const mine = [];
    const given = new HoldfastClient({ baseUrl: `http://127.0.0.1:${server.address().port}`, apiKey: "k" });
    keys.length = 1; // answered at once from here
    for await (const event of given.stream({ message: "hi", idempotencyKey: "msg-7" })) mine.push(event.seq);
    assert.equal(keys[1], "msg-7");
  } finally {
    server.closeAllConnections();
    server.close();
  }
});

test("an artifact event becomes a data part with its download path", async () => {
  const { ARTIFACT_PART, toUIMessageStream } = await import("../dist/esm/ai-sdk.js");
  const base = { task_id: "t", turn_id: "u", timestamp: 1 };
  async function* events() {
    yield { ...base, seq: 1, type: "artifact", tool_call_id: "c1", path: "outputs/r.md", name: "r.md", size: 6, sha256: "ab", download: "/tasks/t/files/outputs/r.md" };
  }
  const chunks = [];
  const reader = toUIMessageStream(events()).getReader();
  for (let read = await reader.read(); !read.done; read = await reader.read()) chunks.push(read.value);
  const part = chunks.find((chunk) => chunk.type === `data-${ARTIFACT_PART}`);
  assert.deepEqual(part, {
    type: "data-holdfast_artifact",
    id: "artifact:c1:outputs/r.md",
    data: { tool_call_id: "c1", path: "outputs/r.md", name: "r.md", size: 6, sha256: "ab", download: "/tasks/t/files/outputs/r.md" },
  });
});
