// A 400-delta turn read through a proxy that the Python side resets again and
// again (tests/client/test_typescript_client.py): each seq comes exactly once.
// HOLDFAST_PROGRESS_FILE gets the last seq delivered after every event, which
// is what the Python side waits on before the next reset.
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { test } from "node:test";

import { HoldfastClient } from "../dist/esm/index.js";
import { FAST, assertOneTurn, client, collect, engine, script } from "./helpers.mjs";

const proxyUrl = process.env.HOLDFAST_PROXY_URL;
const progress = process.env.HOLDFAST_PROGRESS_FILE;
const skip = proxyUrl && progress && engine.key ? false : "no proxy: HOLDFAST_PROXY_URL unset";

test("every event exactly once through connections cut mid-turn", { skip }, async () => {
  const hf = new HoldfastClient({ baseUrl: proxyUrl, apiKey: engine.key, reconnect: FAST });
  const turn = hf.stream({ message: script({ text: "tok ", deltas: 400, delay_ms: 10 }) });
  const events = [];
  for await (const event of turn) {
    events.push(event);
    writeFileSync(progress, `${turn.taskId} ${event.seq}\n`);
  }
  assertOneTurn(events);
  assert.equal(turn.transcript.text, "tok ".repeat(400));
  // The task's log read in one connection straight from the gateway: the same events.
  const truth = await collect(client().replay(turn.taskId));
  assert.deepEqual(events, truth);
  writeFileSync(progress, `${turn.taskId} done\n`);
});
