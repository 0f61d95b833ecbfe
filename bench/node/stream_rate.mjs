// Events/s of @holdfast/client against a bare fetch + SSE frame splitter, on the
// same engine: bench/phases/typescript.py runs it and prints the ratio.
//
//   node stream_rate.mjs <built package dir> <url> <key> <deltas> <repeats>
//
// Prints one JSON line: {"live": {"sdk": r, "bare": r, "events": n},
// "replay": {...}}, each rate the best of <repeats> runs, sides interleaved
// (bare first) so a busy moment of the machine does not fall on one side only.
import { pathToFileURL } from "node:url";
import { join } from "node:path";

const [packageDir, url, key, deltasArg, repeatsArg] = process.argv.slice(2);
const { HoldfastClient } = await import(pathToFileURL(join(packageDir, "dist/esm/index.js")).href);
const deltas = Number(deltasArg);
const repeats = Number(repeatsArg);
const message = "/script " + JSON.stringify({ text: "tok ", deltas });
const headers = { "X-Engine-Key": key, "Content-Type": "application/json" };

const FRAME_END = /\r\n\r\n|\n\n|\r\r/;

// The baseline: fetch's body decoded and split into frames at blank lines; a
// frame counts unless it is a heartbeat. No typing, no cursor, no resume.
async function bare(response) {
  const decoder = new TextDecoder();
  let buffer = "";
  let count = 0;
  for await (const chunk of response.body) {
    buffer += decoder.decode(chunk, { stream: true });
    let blank;
    // Lines end in CRLF, LF or CR (the SSE spec); sse-starlette writes CRLF.
    while ((blank = FRAME_END.exec(buffer)) !== null) {
      const frame = buffer.slice(0, blank.index);
      buffer = buffer.slice(blank.index + blank[0].length);
      if (frame.includes("data:") && !frame.includes("event: heartbeat")) count += 1;
    }
  }
  return count;
}

async function timed(run) {
  const start = performance.now();
  const count = await run();
  return [count, (performance.now() - start) / 1000];
}

async function countAll(iterable) {
  let count = 0;
  for await (const _ of iterable) count += 1;
  return count;
}

async function best(sdk, baseline) {
  const runs = { sdk: [], bare: [] };
  for (let i = 0; i < repeats; i += 1) {
    runs.bare.push(await timed(baseline));
    runs.sdk.push(await timed(sdk));
  }
  const counts = new Set([...runs.sdk, ...runs.bare].map(([n]) => n));
  if (counts.size !== 1) throw new Error(`the readers saw different event counts: ${[...counts]}`);
  const rate = (side) => Math.max(...runs[side].map(([n, s]) => n / s));
  return { sdk: rate("sdk"), bare: rate("bare"), events: [...counts][0] };
}

const client = new HoldfastClient({ baseUrl: url, apiKey: key });
const live = await best(
  () => countAll(client.stream({ message })),
  async () => {
    const response = await fetch(`${url}/execute`, { method: "POST", headers, body: JSON.stringify({ message }) });
    if (!response.ok) throw new Error(`POST /execute: ${response.status}`);
    return bare(response);
  },
);
const stored = client.stream({ message });
await countAll(stored);
const taskId = stored.taskId;
const replay = await best(
  () => countAll(client.replay(taskId)),
  async () => {
    const response = await fetch(`${url}/execute/replay?task_id=${encodeURIComponent(taskId)}`, { headers });
    if (!response.ok) throw new Error(`GET /execute/replay: ${response.status}`);
    return bare(response);
  },
);
console.log(JSON.stringify({ live, replay }));
