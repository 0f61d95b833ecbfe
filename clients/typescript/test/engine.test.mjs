// The client against a real engine: a turn, a replay, HITL, cancel, errors.
import assert from "node:assert/strict";
import { test } from "node:test";

import { HoldfastClient, HoldfastError, isHoldfastError } from "../dist/esm/index.js";
import { assertOneTurn, client, collect, engine, script, skip } from "./helpers.mjs";

test("a turn streams typed events, a second turn continues the task, replay reads after a seq", { skip }, async () => {
  const hf = client();
  const turn = hf.stream({ message: "hello world" });
  const events = await collect(turn);
  assertOneTurn(events, undefined);
  assert.ok(turn.taskId);
  assert.equal(turn.turnId, events[0].turn_id);
  assert.equal(turn.transcript.text, "You said: hello world");
  assert.equal(turn.lastSeq, events.at(-1).seq);

  const second = hf.stream({ message: "who am I?", taskId: turn.taskId });
  assert.match((await second.untilDone()).text, /Earlier you said: hello world/);
  const replayed = await collect(hf.replay(turn.taskId, { afterSeq: turn.lastSeq }));
  assert.deepEqual(
    replayed.map((e) => e.seq),
    Array.from({ length: second.lastSeq - turn.lastSeq }, (_, i) => turn.lastSeq + 1 + i),
  );
  const state = await hf.getTask(turn.taskId);
  assert.equal(state.task_id, turn.taskId);
  assert.deepEqual((await hf.workingMemory(turn.taskId)).working_memory, {});
  const page = await hf.listTasks({ limit: 50 });
  assert.ok(Array.isArray(page.tasks));
  assert.equal((await hf.deleteTask(turn.taskId)).status, "deleted");
});

test("thinking and text are kept apart; the API's other reads answer", { skip }, async () => {
  const hf = client();
  const turn = hf.stream({ message: script({ thinking: "let me see", text: "fine thanks" }) });
  assertOneTurn(await collect(turn), undefined);
  assert.equal(turn.transcript.thinking, "let me see");
  assert.equal(turn.transcript.text, "fine thanks");
  assert.ok((await hf.listAgents()).agents.some((a) => a.name === "general"));
  assert.ok(Array.isArray((await hf.listSkills()).skills));
  assert.ok(Array.isArray((await hf.listServers()).servers));
  assert.equal(typeof (await hf.getSoul()).content, "string");
  assert.deepEqual((await hf.pending(turn.taskId)).pending, []);
});

test("a permission prompt is answered and the turn goes on", { skip }, async () => {
  const hf = client();
  const turn = hf.stream({
    message: script({ text: "", tool_calls: [{ name: "bash", input: { command: "echo ts" } }] }),
  });
  const seen = [];
  for await (const event of turn) {
    seen.push(event);
    if (event.type === "hitl_request") {
      const { pending } = await hf.pending(turn.taskId);
      assert.deepEqual(pending.map((p) => p.request_id), [event.request_id]);
      assert.equal(pending[0].kind, "permission");
      const answered = await hf.respond(turn.taskId, "yes", { request_id: event.request_id });
      assert.equal(answered.status, "resumed");
    }
  }
  assertOneTurn(seen, undefined);
  const result = seen.find((e) => e.type === "tool_result");
  assert.equal(result.error ?? null, null);
  assert.equal(result.output.stdout, "ts\n");
});

test("cancel ends a running turn; cancelling an idle task is a typed 409", { skip }, async () => {
  const hf = client();
  const turn = hf.stream({ message: script({ text: "x ", deltas: 400, delay_ms: 20 }) });
  const seen = [];
  for await (const event of turn) {
    seen.push(event);
    if (event.type === "text_delta" && seen.filter((e) => e.type === "text_delta").length === 5) {
      await hf.cancel(turn.taskId);
    }
  }
  assertOneTurn(seen, "cancelled");
  assert.ok(seen.filter((e) => e.type === "text_delta").length < 400);
  await assert.rejects(hf.cancel(turn.taskId), (error) => {
    assert.ok(isHoldfastError(error, "NO_RUNNING_TURN"));
    assert.equal(error.status, 409);
    return true;
  });
});

test("errors carry the envelope's status, code, message and details", { skip }, async () => {
  const hf = client();
  await assert.rejects(hf.workingMemory(`absent-${Date.now()}`), (error) => {
    assert.ok(error instanceof HoldfastError);
    assert.equal(error.status, 404);
    assert.equal(error.code, "TASK_NOT_FOUND");
    assert.ok(error.message);
    return true;
  });
  await assert.rejects(collect(hf.stream({ message: "hi", taskId: "not a valid id!" })), (error) => {
    assert.equal(error.status, 422);
    assert.equal(error.code, "INVALID_REQUEST");
    assert.ok(error.details.errors.some((e) => e.loc.join("/") === "body/task_id"));
    return true;
  });
  const stranger = new HoldfastClient({ baseUrl: engine.url, apiKey: `hf_wrong_${Date.now()}` });
  await assert.rejects(stranger.listAgents(), (error) => error.status === 401 && error.code === "INVALID_KEY");
});

test("an AbortSignal stops a stream and a request", { skip }, async () => {
  const hf = client();
  const controller = new AbortController();
  const turn = hf.stream({ message: script({ text: "y ", deltas: 200, delay_ms: 20 }), signal: controller.signal });
  let deltas = 0;
  await assert.rejects(
    (async () => {
      for await (const event of turn) {
        if (event.type === "text_delta" && ++deltas === 3) controller.abort();
      }
    })(),
    (error) => error.name === "AbortError",
  );
  assert.equal(deltas, 3);
  await hf.cancel(turn.taskId);
  const aborted = AbortSignal.abort();
  await assert.rejects(hf.with({ signal: aborted }).listAgents(), (error) => error.name === "AbortError");
});

test("a stream token opens the replay for a native EventSource", { skip }, async () => {
  const hf = client();
  const turn = hf.stream({ message: "token please" });
  await turn.untilDone();
  const url = new URL(await hf.eventSourceUrl(turn.taskId));
  assert.ok(url.searchParams.get("token"));
  assert.equal(url.searchParams.get("X-Engine-Key"), null);
  // What EventSource would do: a GET without the key.
  const response = await fetch(url);
  assert.equal(response.status, 200);
  assert.match(response.headers.get("content-type"), /^text\/event-stream/);
  assert.match(await response.text(), /event: thread_lifecycle/);
});
