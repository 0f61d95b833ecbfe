// A turn from Node (≥ 18): text as it streams, a permission prompt answered,
// the task's id kept to replay it later. Type-checked by `npm run typecheck`.
//
//   HOLDFAST_API_KEY=hf_... node --experimental-strip-types examples/node.ts
import { HoldfastClient, isHoldfastError } from "../src/index.js";

const client = new HoldfastClient({
  baseUrl: process.env.HOLDFAST_URL ?? "http://127.0.0.1:8000",
  apiKey: process.env.HOLDFAST_API_KEY ?? "",
});

const turn = client.stream({ message: "List the files in your workspace", agent: "general" });
for await (const event of turn) {
  switch (event.type) {
    case "text_delta":
      process.stdout.write(event.text);
      break;
    case "tool_call":
      console.log(`\n[${event.tool}]`, JSON.stringify(event.input));
      break;
    case "hitl_request":
      // A real UI asks the person; this script allows what it is asked.
      await client.respond(event.task_id, "yes", { request_id: event.request_id });
      break;
    case "thread_lifecycle":
      if (event.phase !== "started") console.log(`\n(${event.phase}: ${event.stop_reason})`);
      break;
  }
}
console.log("task:", turn.taskId, "text:", turn.transcript.text.length, "chars");

try {
  await client.getTask("no-such-task");
} catch (error) {
  if (isHoldfastError(error, "TASK_NOT_FOUND")) console.log(error.status, error.message);
  else throw error;
}
