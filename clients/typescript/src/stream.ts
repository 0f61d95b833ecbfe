/** A turn's (or a replay's) events over `fetch` streaming, resumed after every drop. */

import { HoldfastError } from "./errors.js";
import type { Event } from "./generated/events.js";
import type { Resumer } from "./resume.js";
import { FrameDecoder } from "./sse.js";
import { TurnText } from "./text.js";
import { anySignal, type Transport } from "./transport.js";

/**
 * The events of one turn (or replay), each once and in order; iterate it once
 * with `for await`. The request is sent when iteration starts.
 *
 * `taskId` and `turnId` are known as soon as the engine answered, `lastSeq`
 * is the seq of the last event yielded (the cursor to replay after),
 * `transcript` the turn's text so far with discarded deltas taken out.
 * Heartbeats are not yielded. Breaking out of the loop stops reading (the
 * turn goes on: `client.cancel` stops it); the stream's `signal` does too,
 * and makes the loop throw the signal's reason.
 */
export class TurnStream implements AsyncIterable<Event> {
  readonly transcript = new TurnText();
  private iterated = false;

  constructor(
    private readonly transport: Transport,
    private readonly resumer: Resumer,
    private readonly readTimeoutMs: number,
    private readonly signal?: AbortSignal,
  ) {}

  get taskId(): string | null {
    return this.resumer.taskId;
  }

  get turnId(): string | null {
    return this.resumer.turnId;
  }

  get lastSeq(): number {
    return this.resumer.lastSeq;
  }

  [Symbol.asyncIterator](): AsyncIterator<Event> {
    if (this.iterated) throw new Error("a TurnStream is iterated once");
    this.iterated = true;
    return this.run();
  }

  /** Read the stream to its end; the turn's text. */
  async untilDone(): Promise<TurnText> {
    for await (const _ of this) {
      // the transcript takes in every event
    }
    return this.transcript;
  }

  private async *run(): AsyncGenerator<Event, void, undefined> {
    const r = this.resumer;
    for (;;) {
      const attempt = r.request();
      // Aborted by the caller's signal, by a silent connection, or when this
      // attempt is over (which releases its connection).
      const connection = new AbortController();
      const signal = this.signal ? anySignal([this.signal, connection.signal]) : connection.signal;
      const silence = new ReadTimer(this.readTimeoutMs, () =>
        connection.abort(new Error(`no byte for ${this.readTimeoutMs} ms`)),
      );
      let wait: number | null;
      try {
        const response = await this.transport.fetch(
          attempt.method,
          this.transport.url(attempt.path, attempt.query),
          { json: attempt.json, headers: attempt.headers, signal },
        );
        if (response.status >= 300) {
          wait = r.refused(response, await response.text());
        } else {
          r.opened(response);
          if (response.body === null) throw new Error("an event stream without a body");
          const reader = response.body.getReader();
          const frames = new FrameDecoder();
          for (;;) {
            silence.reading();
            const { done, value } = await reader.read();
            silence.read();
            if (done) break;
            for (const frame of frames.feed(value)) {
              const event = r.feed(frame);
              if (event === null) continue;
              this.transcript.feed(event);
              yield event;
              if (r.done) return;
            }
          }
          wait = r.ended();
        }
      } catch (error) {
        if (this.signal?.aborted) throw this.signal.reason;
        if (error instanceof HoldfastError) throw error;
        wait = r.lost(error);
      } finally {
        silence.stop();
        connection.abort();
      }
      if (wait === null) return; // the stream ended as it should
      await sleep(wait, this.signal);
    }
  }
}

/**
 * Calls `onSilent` when one read waited `ms` for the server: only the wait on
 * the connection is timed, never the consumer's work between reads (a person
 * answering a prompt inside the loop). One timer per connection, not per read.
 */
class ReadTimer {
  private since: number | null = null;
  private timer: ReturnType<typeof setTimeout> | undefined;

  constructor(
    private readonly ms: number,
    private readonly onSilent: () => void,
  ) {
    this.arm(ms);
  }

  /** A read starts waiting. */
  reading(): void {
    this.since = Date.now();
  }

  /** The read got its bytes. */
  read(): void {
    this.since = null;
  }

  stop(): void {
    clearTimeout(this.timer);
  }

  private arm(delay: number): void {
    this.timer = setTimeout(() => {
      const left = this.since === null ? this.ms : this.since + this.ms - Date.now();
      if (left > 0) this.arm(left);
      else this.onSilent();
    }, delay);
    // Node: a stream abandoned mid-iteration must not keep the process alive.
    (this.timer as { unref?: () => void }).unref?.();
  }
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
