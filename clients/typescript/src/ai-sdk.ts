/**
 * `@holdfast/client/ai-sdk`: a `ChatTransport` for the Vercel AI SDK's `useChat`
 * (`ai` 7.x), so a chat UI talks to a Holdfast task: one chat is one task
 * (the chat's id is the task's id, unless `taskId` maps it).
 *
 * `sendMessages` sends the last user message's text to `POST /execute` and
 * streams the turn; `reconnectToStream` finds the task's running turn and
 * streams it again from its start (`resumeStreamIsReplay`), so
 * `useChat({ transport, resume: true })` picks a turn up after a page reload.
 * Both streams resume by themselves after a dropped connection, as every
 * stream of the client does. Only types are imported from `ai`: it is a peer,
 * not a dependency.
 *
 * How events become UI message chunks: text and thinking deltas are text and
 * reasoning parts; a tool call and its result a dynamic tool part; a
 * permission prompt or question a dynamic tool part of {@link HITL_TOOL}
 * waiting for its output (answer it with `client.respond`; its
 * `hitl_resolved` is the output); `usage` message metadata; a model call that
 * was cut off and made again (`turn_resumed` with a discard range) a
 * `reset-step`, which takes back what that call had shown; an `artifact` (a file
 * a tool wrote under `outputs/`) a `data-holdfast_artifact` part with its download path;
 * a subagent (the `delegate` tool) a `data-holdfast_subagent` part, updated from
 * `subagent_started` to `subagent_completed` (its child task's own events are not
 * the chat's: follow the child's task for them).
 */

import type { ChatTransport, FinishReason, UIMessage, UIMessageChunk } from "ai";

import type { HoldfastClient, StreamOptions } from "./client.js";
import { isHoldfastError } from "./errors.js";
import type { TaskState } from "./generated/api.js";
import type { Event } from "./generated/events.js";

/** The tool name of a permission prompt or a question in a message's parts. */
export const HITL_TOOL = "holdfast_hitl";
/** The data part of a file a tool wrote under `outputs/` (`data-holdfast_artifact`). */
export const ARTIFACT_PART = "holdfast_artifact";
/** The data part of a subagent the turn delegated to (`data-holdfast_subagent`). */
export const SUBAGENT_PART = "holdfast_subagent";

export interface HoldfastChatTransportOptions {
  client: HoldfastClient;
  /** `POST /execute` options for every message: `agent`, `model`, `userId`, `onBusy`. */
  execute?: Pick<StreamOptions, "agent" | "model" | "userId" | "onBusy">;
  /** The task of a chat (its id, by default). */
  taskId?: (chatId: string) => string;
}

export class HoldfastChatTransport<M extends UIMessage = UIMessage> implements ChatTransport<M> {
  /** A reconnect streams the turn from its start: the UI starts the message over. */
  readonly resumeStreamIsReplay = true;
  private readonly client: HoldfastClient;
  private readonly execute: HoldfastChatTransportOptions["execute"];
  private readonly taskOf: (chatId: string) => string;

  constructor(options: HoldfastChatTransportOptions) {
    this.client = options.client;
    this.execute = options.execute;
    this.taskOf = options.taskId ?? ((chatId) => chatId);
  }

  async sendMessages(options: Parameters<ChatTransport<M>["sendMessages"]>[0]): Promise<ReadableStream<UIMessageChunk>> {
    if (options.trigger === "regenerate-message") {
      // Holdfast retries by its own message ids (retryMessageId); the UI's are not those.
      throw new Error("regenerate is not supported by the Holdfast transport yet");
    }
    const last = options.messages.at(-1);
    const message = (last?.parts ?? [])
      .map((part) => (part.type === "text" ? part.text : ""))
      .join("");
    const turn = this.client.stream({
      ...this.execute,
      message,
      taskId: this.taskOf(options.chatId),
      signal: options.abortSignal,
    });
    return toUIMessageStream(turn);
  }

  async reconnectToStream(
    options: Parameters<ChatTransport<M>["reconnectToStream"]>[0],
  ): Promise<ReadableStream<UIMessageChunk> | null> {
    const taskId = this.taskOf(options.chatId);
    let task: TaskState;
    try {
      task = await this.client.getTask(taskId);
    } catch (error) {
      if (isHoldfastError(error, "TASK_NOT_FOUND")) return null;
      throw error;
    }
    // current_turn is the task's latest turn, also when it has ended.
    const turnId = task.current_turn?.["turn_id"];
    if (task.status === "idle" || typeof turnId !== "string") return null; // nothing to resume
    return toUIMessageStream(this.client.follow(taskId, turnId, { signal: options.abortSignal }));
  }
}

/** A turn's events as the UI message chunks `useChat` reads. */
export function toUIMessageStream(events: AsyncIterable<Event>): ReadableStream<UIMessageChunk> {
  const chunks = new ChunkMapper();
  const iterator = events[Symbol.asyncIterator]();
  return new ReadableStream<UIMessageChunk>({
    async pull(controller) {
      try {
        // Until a chunk is out: a pull that enqueues nothing is not called again.
        for (;;) {
          const next = await iterator.next();
          const out = next.done ? chunks.end() : chunks.map(next.value);
          for (const chunk of out) controller.enqueue(chunk);
          if (next.done) controller.close();
          if (next.done || out.length > 0) return;
        }
      } catch (error) {
        controller.error(error);
      }
    },
    async cancel() {
      await iterator.return?.();
    },
  });
}

const FINISH_REASONS: Record<string, FinishReason> = {
  end_turn: "stop",
  max_tokens: "length",
};

/** The chunks of each event, in order; the one place the two vocabularies meet. */
export class ChunkMapper {
  // The text or reasoning part being streamed, closed by anything else.
  private open: { kind: "text" | "reasoning"; id: string } | null = null;
  // A tool result ends a model call: the next output opens another step.
  private stepEnded = false;

  map(event: Event): UIMessageChunk[] {
    const out: UIMessageChunk[] = [];
    if (event.subagent != null) {
      if (event.type === "subagent_started" || event.type === "subagent_completed") {
        const { task_id, agent, depth, tool_call_id } = event.subagent;
        const done = event.type === "subagent_completed";
        out.push({
          type: `data-${SUBAGENT_PART}`,
          id: `subagent:${tool_call_id}`,
          data: {
            task_id,
            agent,
            depth,
            tool_call_id,
            status: done ? event.status : "running",
            answer: done ? event.answer : null,
          },
        });
      }
      return out;
    }
    switch (event.type) {
      case "thread_lifecycle":
        if (event.phase === "started") {
          out.push({ type: "start", messageId: event.turn_id ?? undefined }, { type: "start-step" });
          return out;
        }
        this.close(out);
        if (event.phase === "errored") out.push({ type: "error", errorText: event.stop_reason ?? "the turn failed" });
        out.push({ type: "finish-step" });
        out.push({ type: "finish", finishReason: FINISH_REASONS[event.stop_reason ?? ""] ?? (event.phase === "errored" ? "error" : "other") });
        return out;
      case "text_delta":
      case "thinking_delta": {
        const kind = event.type === "text_delta" ? "text" : "reasoning";
        this.step(out);
        if (this.open?.kind !== kind) {
          this.close(out);
          this.open = { kind, id: `${event.turn_id}:${event.seq}` };
          out.push({ type: `${kind}-start`, id: this.open.id });
        }
        out.push({ type: `${kind}-delta`, id: this.open.id, delta: event.text });
        return out;
      }
      case "content_block_stop":
        this.close(out);
        return out;
      case "tool_call":
        this.step(out);
        this.close(out);
        out.push({ type: "tool-input-available", toolCallId: event.tool_call_id, toolName: event.tool, input: event.input, dynamic: true });
        return out;
      case "tool_result":
        this.stepEnded = true;
        out.push(
          event.error != null
            ? { type: "tool-output-error", toolCallId: event.tool_call_id, errorText: event.error, dynamic: true }
            : { type: "tool-output-available", toolCallId: event.tool_call_id, output: event.output, dynamic: true },
        );
        return out;
      case "hitl_request": {
        this.close(out);
        const { request_id, kind, question, tool_call, expires_at } = event;
        out.push({
          type: "tool-input-available",
          toolCallId: `hitl:${request_id}`,
          toolName: HITL_TOOL,
          input: { task_id: event.task_id, request_id, kind, question, tool_call, expires_at },
          dynamic: true,
        });
        return out;
      }
      case "hitl_resolved":
        out.push({ type: "tool-output-available", toolCallId: `hitl:${event.request_id}`, output: { answer: event.answer ?? null }, dynamic: true });
        return out;
      case "turn_resumed":
        if (event.discard_from_seq != null) {
          // The cut-off model call's output was this step's: it is made again from its start.
          this.open = null;
          out.push({ type: "reset-step" });
        }
        return out;
      case "usage":
        out.push({ type: "message-metadata", messageMetadata: { usage: event } });
        return out;
      case "artifact": {
        const { tool_call_id, path, name, size, sha256, download } = event;
        out.push({
          type: `data-${ARTIFACT_PART}`,
          id: `artifact:${tool_call_id}:${path}`,
          data: { tool_call_id, path, name, size, sha256, download },
        });
        return out;
      }
      case "error":
        this.close(out);
        out.push({ type: "error", errorText: `${event.error}: ${event.message}` });
        return out;
      default:
        return out;
    }
  }

  /** The chunks that close what is open when the events stop before the turn's end. */
  end(): UIMessageChunk[] {
    const out: UIMessageChunk[] = [];
    this.close(out);
    return out;
  }

  private close(out: UIMessageChunk[]): void {
    if (this.open !== null) out.push({ type: `${this.open.kind}-end`, id: this.open.id });
    this.open = null;
  }

  private step(out: UIMessageChunk[]): void {
    if (!this.stepEnded) return;
    this.stepEnded = false;
    this.close(out);
    out.push({ type: "finish-step" }, { type: "start-step" });
  }
}
