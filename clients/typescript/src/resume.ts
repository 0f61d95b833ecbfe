/**
 * What a stream does across its connections: which request to send next, which
 * events to hand on, and how long to wait before reconnecting. No I/O here:
 * `stream.ts` carries it out. The same rules as the Python client's `_resume.py`.
 *
 * A stream is resumed from the seq of the last event handed to the caller
 * (`GET /execute/replay` with `Last-Event-ID`), so every event comes once and
 * in order. Waits follow the server's `retry:` field (else `delayMs`), doubled
 * on each consecutive failure.
 */

import { BAD_RESPONSE, CONNECTION_LOST, HoldfastError } from "./errors.js";
import type { ExecuteRequest } from "./generated/api.js";
import type { Event } from "./generated/events.js";
import type { Frame } from "./sse.js";

/** A replay or reconnect answered with one of these is worth trying again. */
const RETRYABLE_STATUSES = new Set([429, 502, 503, 504]);
// A 429 on POST /execute is the tenant's limit on turns: the caller's to wait on.
const RETRYABLE_POST_STATUSES = new Set([502, 503, 504]);

/**
 * How a stream reconnects after its connection dropped: `delayMs` is the first
 * wait when the server named none in a `retry:` field (the server's wins);
 * each further consecutive failure doubles it, up to `maxDelayMs`. After
 * `maxAttempts` failures in a row with nothing received in between, the
 * stream throws `CONNECTION_LOST`.
 */
export interface Reconnect {
  delayMs: number;
  maxDelayMs: number;
  maxAttempts: number;
}

export const DEFAULT_RECONNECT: Reconnect = { delayMs: 500, maxDelayMs: 15_000, maxAttempts: 12 };

/** One HTTP request of a stream. */
export interface Attempt {
  method: "GET" | "POST";
  path: string;
  query: Record<string, string>;
  headers: Record<string, string>;
  json?: ExecuteRequest;
}

export interface ResumerOptions {
  /** Starts a turn (`POST /execute`); the stream ends at that turn's end. */
  body?: ExecuteRequest;
  taskId?: string | null;
  /** Follows this turn of `taskId` from its start to its end. */
  turnId?: string | null;
  afterSeq?: number;
  afterTimestamp?: number | null;
  reconnect?: Reconnect;
  /** Sent with the POST and with the POST sent again (default: a new UUID). */
  idempotencyKey?: string;
}

/**
 * The state of one stream across its connections. With `body` it starts a
 * turn and ends at its terminal `thread_lifecycle`; with `turnId` it follows
 * that turn; with neither it replays `taskId`'s events after `afterSeq` and
 * ends when the server ends the replay.
 */
export class Resumer {
  taskId: string | null;
  turnId: string | null;
  /** The seq of the last event handed to the caller: the resume cursor. */
  lastSeq: number;
  done = false;
  readonly followsTurn: boolean;
  /** The engine runs the message once however often it arrives with this key. */
  readonly idempotencyKey: string;

  private readonly body: ExecuteRequest | undefined;
  private readonly afterTimestamp: number | null;
  private readonly policy: Reconnect;
  private posted: boolean;
  private firstConnection = false;
  // Until the turn's own first event is seen after a reconnect that had no
  // cursor yet, older turns' events are skipped.
  private started = false;
  private serverRetryMs: number | null = null;
  private retryAfterMs: number | null = null;
  private failures = 0;

  constructor(options: ResumerOptions) {
    this.body = options.body;
    this.taskId = options.taskId ?? null;
    this.turnId = options.turnId ?? null;
    this.lastSeq = options.afterSeq ?? 0;
    this.afterTimestamp = options.afterTimestamp ?? null;
    this.policy = options.reconnect ?? DEFAULT_RECONNECT;
    this.posted = this.body === undefined;
    this.followsTurn = this.body !== undefined || this.turnId !== null;
    this.idempotencyKey = options.idempotencyKey ?? globalThis.crypto.randomUUID();
  }

  private get posting(): boolean {
    return this.body !== undefined && !this.posted;
  }

  /** The next request to send. */
  request(): Attempt {
    if (this.posting) {
      const headers = { "Idempotency-Key": this.idempotencyKey };
      return { method: "POST", path: "/execute", query: {}, headers, json: this.body };
    }
    if (this.taskId === null) throw new Error("a replay needs a task id");
    const query: Record<string, string> = { task_id: this.taskId };
    const headers: Record<string, string> = {};
    if (this.lastSeq > 0) headers["Last-Event-ID"] = String(this.lastSeq);
    else if (this.afterTimestamp !== null) query["after"] = String(this.afterTimestamp);
    return { method: "GET", path: "/execute/replay", query, headers };
  }

  /** A 2xx answer's headers arrived. */
  opened(response: Response): void {
    const kind = response.headers.get("Content-Type") ?? "";
    if (!kind.startsWith("text/event-stream")) {
      // Something between us and the engine answered (a captive portal, a
      // misrouted proxy): not a stream to read, nor to retry blindly.
      throw new HoldfastError(
        response.status,
        BAD_RESPONSE,
        `expected an event stream, got ${kind || "no Content-Type"} from ${response.url}`,
      );
    }
    this.retryAfterMs = null;
    this.firstConnection = this.posting;
    if (this.firstConnection) {
      this.posted = true;
      this.taskId = response.headers.get("X-Task-Id") ?? this.taskId;
      this.turnId = response.headers.get("X-Turn-Id");
    }
  }

  /**
   * A non-2xx answer: the wait before trying again, or its error thrown. A
   * `POST /execute` is sent again on a 502/503/504 (its Idempotency-Key makes
   * that safe); any other refusal started nothing and is the caller's to
   * decide on (a 409 `TURN_IN_PROGRESS`, a 429 for the tenant's turns).
   */
  refused(response: Response, body: string): number {
    const error = HoldfastError.fromResponse(response, body);
    const retryable = this.posting ? RETRYABLE_POST_STATUSES : RETRYABLE_STATUSES;
    if (!retryable.has(response.status)) throw error;
    this.retryAfterMs = error.retryAfter === null ? null : error.retryAfter * 1000;
    return this.nextWait(error);
  }

  /** The event to hand to the caller for this frame, if any. */
  feed(frame: Frame): Event | null {
    if (frame.retry !== null) this.serverRetryMs = frame.retry;
    if (!frame.data) return null;
    if (frame.event === "heartbeat") {
      this.failures = 0; // the connection is alive, with nothing to say
      return null;
    }
    const event = parseEvent(frame.data);
    const seq = event.seq;
    // Delivered before the connection dropped (or a heartbeat that came
    // without its event name: they have no seq).
    if (typeof seq !== "number" || seq <= this.lastSeq) return null;
    if (!this.started && this.followsTurn) {
      if (!this.isOurs(event)) {
        this.lastSeq = seq; // an earlier turn's: skipped, not read again
        return null;
      }
      this.started = true;
      this.turnId = event.turn_id ?? null;
    }
    this.lastSeq = seq;
    this.failures = 0;
    if (
      this.followsTurn &&
      event.type === "thread_lifecycle" &&
      event.phase !== "started" &&
      event.turn_id === this.turnId
    ) {
      this.done = true;
    }
    return event;
  }

  /**
   * Whether this is the first event of the stream's turn. On the `POST`'s own
   * connection the server sends only what belongs to the request. After a
   * reconnect that had no cursor yet, it is the event of the turn the `POST`
   * named in `X-Turn-Id`, or — for a steered message, whose `X-Turn-Id` is the
   * message's id — the `user_message` carrying that id.
   */
  private isOurs(event: Event): boolean {
    if (this.firstConnection || this.turnId === null) return true;
    if (event.type === "user_message" && event.message_id === this.turnId) return true;
    return event.turn_id === this.turnId;
  }

  /** The server closed the stream cleanly: null when that finishes it, else the wait. */
  ended(): number | null {
    if (!this.followsTurn) {
      this.done = true;
      return null;
    }
    return this.nextWait(null);
  }

  /**
   * The connection failed: the wait before reconnecting, or throw. A
   * `POST /execute` that dropped before its answer may have started the
   * turn: it is sent again with the same Idempotency-Key, and the engine
   * streams that turn instead of starting another.
   */
  lost(cause: unknown): number {
    return this.nextWait(cause);
  }

  private nextWait(cause: unknown): number {
    this.failures += 1;
    if (this.failures > this.policy.maxAttempts) {
      throw new HoldfastError(
        null,
        CONNECTION_LOST,
        `gave up after ${this.policy.maxAttempts} reconnects in a row ` +
          `(last seq delivered: ${this.lastSeq}; last failure: ${String(cause)})`,
        { task_id: this.taskId, last_seq: this.lastSeq },
        null,
        { cause },
      );
    }
    const base = this.serverRetryMs ?? this.policy.delayMs;
    const wait = Math.min(this.policy.maxDelayMs, base * 2 ** (this.failures - 1));
    return this.retryAfterMs === null ? wait : Math.max(wait, this.retryAfterMs);
  }
}

/**
 * One event's wire JSON. A type this client does not know (a newer engine)
 * comes through as it is, with its `type` outside the {@link Event} union:
 * old clients keep working when the engine learns to say more.
 */
export function parseEvent(data: string): Event {
  const raw: unknown = JSON.parse(data);
  if (typeof raw !== "object" || raw === null || typeof (raw as { type?: unknown }).type !== "string") {
    throw new HoldfastError(null, BAD_RESPONSE, "an event is a JSON object with a string 'type'");
  }
  return raw as Event;
}
