// The AI SDK adapter, read by the real `ai` package's stream consumer
// (readUIMessageStream: what useChat runs on each chunk), without a browser.
import assert from "node:assert/strict";
import { test } from "node:test";

import { readUIMessageStream } from "ai";

import { HITL_TOOL, HoldfastChatTransport, toUIMessageStream } from "../dist/esm/ai-sdk.js";
import { client, script, skip } from "./helpers.mjs";

async function lastMessage(stream) {
  let message;
  for await (const state of readUIMessageStream({ stream, terminateOnError: true })) message = state;
  return message;
}

const textOf = (message) => message.parts.filter((p) => p.type === "text").map((p) => p.text).join("");

function userMessage(text) {
  return [{ id: `u-${Date.now()}`, role: "user", parts: [{ type: "text", text }] }];
}

async function* fromList(events) {
  yield* events;
}

test("a cut-off model call's output is taken back by reset-step", async () => {
  const envelope = (seq) => ({ task_id: "t", turn_id: "turn-1", seq, timestamp: seq });
  const events = [
    { ...envelope(1), type: "thread_lifecycle", phase: "started" },
    { ...envelope(2), type: "thinking_delta", text: "hmm" },
    { ...envelope(3), type: "content_block_start", block_index: 1, block_type: "text" },
    { ...envelope(4), type: "text_delta", text: "half an ans" },
    { ...envelope(5), type: "turn_resumed", reason: "model_retry", discard_from_seq: 2, discard_to_seq: 4 },
    { ...envelope(6), type: "working_memory_update", key: "k", value: "v" },
    { ...envelope(7), type: "text_delta", text: "the whole answer" },
    { ...envelope(8), type: "usage", input_tokens: 3, output_tokens: 4 },
    { ...envelope(9), type: "thread_lifecycle", phase: "completed", stop_reason: "end_turn" },
  ];
  const message = await lastMessage(toUIMessageStream(fromList(events)));
  assert.equal(message.id, "turn-1");
  assert.equal(textOf(message), "the whole answer");
  assert.equal(message.parts.filter((p) => p.type === "reasoning").length, 0);
  assert.equal(message.metadata.usage.output_tokens, 4);
});

test("sendMessages streams a turn into one assistant message", { skip }, async () => {
  const transport = new HoldfastChatTransport({ client: client() });
  const chatId = `chat-${Date.now()}`;
  const stream = await transport.sendMessages({
    trigger: "submit-message",
    chatId,
    messageId: undefined,
    messages: userMessage(script({ thinking: "let me see", text: "fine thanks" })),
    abortSignal: undefined,
  });
  const message = await lastMessage(stream);
  assert.equal(message.role, "assistant");
  assert.equal(textOf(message), "fine thanks");
  assert.equal(message.parts.find((p) => p.type === "reasoning").text, "let me see");
  // The chat is the task: its second message continues it.
  const second = await lastMessage(
    await transport.sendMessages({ trigger: "submit-message", chatId, messageId: undefined, messages: userMessage("who am I?"), abortSignal: undefined }),
  );
  assert.match(textOf(second), /Earlier you said/);
  assert.equal(await transport.reconnectToStream({ chatId }), null); // nothing running
});

test("a permission prompt is a tool part waiting for its answer", { skip }, async () => {
  const hf = client();
  const transport = new HoldfastChatTransport({ client: hf });
  const chatId = `chat-hitl-${Date.now()}`;
  const stream = await transport.sendMessages({
    trigger: "submit-message",
    chatId,
    messageId: undefined,
    messages: userMessage(script({ text: "done", tool_calls: [{ name: "bash", input: { command: "echo ai" } }] })),
    abortSignal: undefined,
  });
  let asked = false;
  let message;
  for await (const state of readUIMessageStream({ stream, terminateOnError: true })) {
    message = state;
    const prompt = state.parts.find((p) => p.type === "dynamic-tool" && p.toolName === HITL_TOOL);
    if (prompt && prompt.state === "input-available" && !asked) {
      asked = true;
      assert.equal(prompt.input.kind, "permission");
      await hf.respond(prompt.input.task_id, "yes", { request_id: prompt.input.request_id });
    }
  }
  assert.ok(asked);
  const tools = message.parts.filter((p) => p.type === "dynamic-tool");
  const bash = tools.find((p) => p.toolName === "bash");
  assert.equal(bash.state, "output-available");
  assert.equal(bash.output.stdout, "ai\n");
  assert.equal(tools.find((p) => p.toolName === HITL_TOOL).state, "output-available");
  // The model's text, then its answer to the tool's result, in two steps.
  assert.match(textOf(message), /^doneTool results: /);
  assert.equal(message.parts.filter((p) => p.type === "step-start").length, 2);
});

test("reconnectToStream picks a running turn up from its start", { skip }, async () => {
  const hf = client();
  const transport = new HoldfastChatTransport({ client: hf });
  const chatId = `chat-resume-${Date.now()}`;
  const page = new AbortController();
  const first = await transport.sendMessages({
    trigger: "submit-message",
    chatId,
    messageId: undefined,
    messages: userMessage(script({ text: "tok ", deltas: 150, delay_ms: 10 })),
    abortSignal: page.signal,
  });
  // The page goes away after a few deltas: its stream stops, the turn goes on.
  const reader = first.getReader();
  for (let deltas = 0; deltas < 5; ) if ((await reader.read()).value?.type === "text-delta") deltas++;
  page.abort();
  await reader.cancel();
  const resumed = await transport.reconnectToStream({ chatId });
  assert.ok(resumed);
  assert.equal(textOf(await lastMessage(resumed)), "tok ".repeat(150));
});
