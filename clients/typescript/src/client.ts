/** `HoldfastClient`: streams that resume themselves, and every operation of the API. */

import { HoldfastError, NO_API_KEY } from "./errors.js";
import type { ExecuteRequest } from "./generated/api.js";
import { type Operations, operations } from "./operations.js";
import { DEFAULT_RECONNECT, type Reconnect, Resumer } from "./resume.js";
import { TurnStream } from "./stream.js";
import { anySignal, Transport } from "./transport.js";

export const DEFAULT_URL = "http://127.0.0.1:8000";
/**
 * Long enough for several of the server's heartbeats (15 s by default): a
 * stream silent for longer than this is dead and is reconnected.
 */
export const DEFAULT_STREAM_READ_TIMEOUT_MS = 60_000;

export interface ClientOptions {
  /** The gateway, e.g. `http://127.0.0.1:8000`. */
  baseUrl?: string;
  /** An API key (`hf_...`), sent as `X-Engine-Key`. */
  apiKey: string;
  /** Another `fetch` (a proxy agent's, a test's); the global one by default. */
  fetch?: typeof fetch;
  /** A non-streaming request's limit (30 s by default). */
  timeoutMs?: number;
  streamReadTimeoutMs?: number;
  reconnect?: Partial<Reconnect>;
  /** Aborts every request and stream of this client (see {@link HoldfastClient.with}). */
  signal?: AbortSignal;
}

/** `POST /execute`'s options, in camelCase (see the engine's README). */
export interface StreamOptions {
  /** The user's message; null or left out for a retry. */
  message?: string | null;
  /** The task to continue; a new task when left out. */
  taskId?: string;
  agent?: string;
  /** What a message for a task with a running turn does. */
  onBusy?: ExecuteRequest["on_busy"];
  userId?: string;
  model?: string;
  media?: ExecuteRequest["media"];
  /** Fork the conversation at this earlier user message, which `message` replaces. */
  editMessageId?: number;
  /** Answer this user message again. */
  retryMessageId?: number;
  /**
   * Sent as `Idempotency-Key` (default: a new UUID): a request whose answer
   * was lost is sent again with it, and the engine runs the message once.
   */
  idempotencyKey?: string;
  /** Stops the stream (the turn goes on: `cancel` stops it). */
  signal?: AbortSignal;
}

export interface ReplayOptions {
  /** The events after this seq (0: from the first). */
  afterSeq?: number;
  /** Or after this epoch-ms time. */
  afterTimestamp?: number;
  signal?: AbortSignal;
}

// StreamOptions' name → ExecuteRequest's: the one place the two spellings meet.
const EXECUTE_FIELDS = {
  message: "message",
  taskId: "task_id",
  agent: "agent",
  onBusy: "on_busy",
  userId: "user_id",
  model: "model",
  media: "media",
  editMessageId: "edit_message_id",
  retryMessageId: "retry_message_id",
} as const satisfies Record<
  Exclude<keyof StreamOptions, "signal" | "idempotencyKey">,
  keyof ExecuteRequest
>;

/** `POST /execute`'s body: the options given (null and undefined left out). */
export function executeBody(options: StreamOptions): ExecuteRequest {
  const body: Record<string, unknown> = {};
  for (const [option, field] of Object.entries(EXECUTE_FIELDS)) {
    const value = options[option as keyof typeof EXECUTE_FIELDS];
    if (value !== null && value !== undefined) body[field] = value;
  }
  return body as ExecuteRequest;
}

/** The same as {@link ClientOptions}, resolved. */
interface Settings {
  transport: Transport;
  reconnect: Reconnect;
  streamReadTimeoutMs: number;
  signal: AbortSignal | undefined;
}

/**
 * A client of one Holdfast engine. Every operation of `operations.ts` is a
 * method (`listTasks`, `getTask`, `respond`, `createExecution`, ...); errors
 * are thrown as {@link HoldfastError}.
 *
 * ```ts
 * const client = new HoldfastClient({ baseUrl: "http://127.0.0.1:8000", apiKey });
 * const turn = client.stream({ message: "hello" });
 * for await (const event of turn) if (event.type === "text_delta") process.stdout.write(event.text);
 * ```
 */
export class HoldfastClient {
  private readonly settings: Settings;

  constructor(options: ClientOptions | Settings) {
    this.settings = "transport" in options ? options : resolve(options);
    const send = this.settings.transport.send.bind(this.settings.transport);
    const signal = this.settings.signal;
    for (const [name, build] of Object.entries(operations)) {
      Object.defineProperty(this, name, {
        value: (...args: unknown[]) => send((build as (...a: unknown[]) => never)(...args), signal),
        enumerable: false,
      });
    }
  }

  /** This client with requests and streams aborted by `signal`. */
  with(options: { signal: AbortSignal }): HoldfastClient {
    return new HoldfastClient({ ...this.settings, signal: options.signal });
  }

  /**
   * Send a message (to `taskId`, or a new task) and stream the turn. A dropped
   * connection is resumed from the last event yielded, so every event comes
   * once, in order, up to the turn's terminal `thread_lifecycle`.
   */
  stream(options: StreamOptions): TurnStream {
    const resumer = new Resumer({
      body: executeBody(options),
      taskId: options.taskId,
      reconnect: this.settings.reconnect,
      idempotencyKey: options.idempotencyKey,
    });
    return this.open(resumer, options.signal);
  }

  /**
   * The task's events after `afterSeq` (or `afterTimestamp`), then those of
   * the turn running now, to its end.
   */
  replay(taskId: string, options: ReplayOptions = {}): TurnStream {
    const resumer = new Resumer({
      taskId,
      afterSeq: options.afterSeq,
      afterTimestamp: options.afterTimestamp,
      reconnect: this.settings.reconnect,
    });
    return this.open(resumer, options.signal);
  }

  /**
   * One turn of the task from its start to its end, e.g. the one a 409
   * `TURN_IN_PROGRESS` names in `details.turn_id`.
   */
  follow(taskId: string, turnId: string, options: { signal?: AbortSignal } = {}): TurnStream {
    return this.open(new Resumer({ taskId, turnId, reconnect: this.settings.reconnect }), options.signal);
  }

  /**
   * A URL of `GET /execute/replay` for the browser's own `EventSource`, which
   * cannot send the key: it carries a stream token (`POST /auth/stream-token`,
   * valid a few minutes) instead. `follow: "task"` keeps it open across turns.
   */
  async eventSourceUrl(
    taskId: string,
    options: { afterSeq?: number; follow?: "task" } = {},
  ): Promise<string> {
    const { token } = await this.streamToken(taskId);
    return this.settings.transport.url("/execute/replay", {
      task_id: taskId,
      after_seq: options.afterSeq,
      follow: options.follow,
      token,
    });
  }

  private open(resumer: Resumer, signal?: AbortSignal): TurnStream {
    const signals = [signal, this.settings.signal].filter((s): s is AbortSignal => s !== undefined);
    const both = signals.length > 1 ? anySignal(signals) : signals[0];
    return new TurnStream(this.settings.transport, resumer, this.settings.streamReadTimeoutMs, both);
  }
}

// The operations, as methods (defined in the constructor from the one table).
// eslint-disable-next-line @typescript-eslint/no-empty-object-type
export interface HoldfastClient extends Operations {}

function resolve(options: ClientOptions): Settings {
  if (!options.apiKey) {
    throw new HoldfastError(null, NO_API_KEY, "no API key: pass apiKey");
  }
  const fetchImpl = options.fetch ?? globalThis.fetch.bind(globalThis);
  return {
    transport: new Transport({
      baseUrl: options.baseUrl ?? DEFAULT_URL,
      apiKey: options.apiKey,
      fetch: fetchImpl,
      timeoutMs: options.timeoutMs ?? 30_000,
    }),
    reconnect: { ...DEFAULT_RECONNECT, ...options.reconnect },
    streamReadTimeoutMs: options.streamReadTimeoutMs ?? DEFAULT_STREAM_READ_TIMEOUT_MS,
    signal: options.signal,
  };
}
