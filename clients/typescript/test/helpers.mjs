// What the engine tests share: the engine's address from the environment
// (tests/client/test_typescript_client.py sets it), and the one-turn check.
import assert from "node:assert/strict";

import { HoldfastClient } from "../dist/esm/index.js";

export const engine = {
  url: process.env.HOLDFAST_URL,
  key: process.env.HOLDFAST_API_KEY,
};
export const skip = engine.url && engine.key ? false : "no engine: HOLDFAST_URL and HOLDFAST_API_KEY unset";
export const FAST = { delayMs: 10, maxDelayMs: 200, maxAttempts: 30 };

export function client(options = {}) {
  return new HoldfastClient({ baseUrl: engine.url, apiKey: engine.key, ...options });
}

/** A message the engine's scripted model acts out. */
export function script(spec) {
  return "/script " + JSON.stringify(spec);
}

export async function collect(stream) {
  const events = [];
  for await (const event of stream) events.push(event);
  return events;
}

/** Every event once, in order, from the turn's start to its end. */
export function assertOneTurn(events, stopReason = "end_turn") {
  const seqs = events.map((e) => e.seq);
  assert.deepEqual(seqs, seqs.map((_, i) => seqs[0] + i));
  const [first, last] = [events[0], events.at(-1)];
  assert.equal(first.type, "thread_lifecycle");
  assert.equal(first.phase, "started");
  assert.equal(last.type, "thread_lifecycle");
  assert.equal(last.phase, "completed");
  if (stopReason !== undefined) assert.equal(last.stop_reason, stopReason);
  assert.deepEqual(new Set(events.map((e) => e.turn_id)), new Set([first.turn_id]));
}
