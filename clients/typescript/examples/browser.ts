// In a page: the key stays on your server, which hands the page a stream token
// for one task; the browser's own EventSource then follows the task.
// Type-checked by `npm run typecheck`.
import { type Event, HoldfastClient } from "../src/index.js";

// On your server (Node, Deno, Bun, an edge function): the key never reaches the page.
export async function tokenUrl(taskId: string): Promise<string> {
  const client = new HoldfastClient({ baseUrl: "https://holdfast.internal", apiKey: "hf_..." });
  return client.eventSourceUrl(taskId, { follow: "task" }); // GET /execute/replay?...&token=
}

// In the page: native EventSource, with its own reconnect and Last-Event-ID.
export function follow(url: string, show: (event: Event) => void): EventSource {
  const source = new EventSource(url);
  for (const type of ["text_delta", "tool_call", "tool_result", "hitl_request", "thread_lifecycle"]) {
    source.addEventListener(type, (message) => show(JSON.parse((message as MessageEvent<string>).data) as Event));
  }
  return source;
}
