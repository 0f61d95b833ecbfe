/** The text of a turn as it stands, with the output of cut-off model calls taken back. */

import type { Event, TurnResumed } from "./generated/events.js";

/** True when the event numbered `seq` is one this `turn_resumed` takes back. */
export function discards(resumed: TurnResumed, seq: number): boolean {
  const from = resumed.discard_from_seq;
  const to = resumed.discard_to_seq;
  return from != null && to != null && from <= seq && seq <= to;
}

/**
 * Accumulates a turn's text and thinking from its events.
 *
 * Feed it every event a stream yields, in order (a stream's `transcript`
 * is fed for you). When a `turn_resumed` names a discard range (the deltas of
 * a model call that was cut off and run again from its start), the deltas in
 * that range are removed, so `text` is what the model finally said, not the
 * interrupted attempt followed by the full one. `discarded` holds the seqs
 * taken back, for a display that has shown them already. A subagent's events
 * (`subagent` set) are its child task's, not the turn's: they are left out.
 */
export class TurnText {
  readonly discarded = new Set<number>();
  private pieces: { seq: number; thinking: boolean; text: string }[] = [];

  /** Take in one event; the seqs it discards, if it is a `turn_resumed`. */
  feed(event: Event): number[] {
    if (event.subagent != null) return [];
    if (event.type === "text_delta" || event.type === "thinking_delta") {
      this.pieces.push({ seq: event.seq, thinking: event.type === "thinking_delta", text: event.text });
      return [];
    }
    if (event.type !== "turn_resumed" || event.discard_from_seq == null) return [];
    const gone = this.pieces.filter((p) => discards(event, p.seq)).map((p) => p.seq);
    if (gone.length > 0) {
      this.pieces = this.pieces.filter((p) => !discards(event, p.seq));
      for (const seq of gone) this.discarded.add(seq);
    }
    return gone;
  }

  /** The turn's answer text so far. */
  get text(): string {
    return this.join(false);
  }

  /** The turn's thinking so far. */
  get thinking(): string {
    return this.join(true);
  }

  private join(thinking: boolean): string {
    return this.pieces
      .filter((p) => p.thinking === thinking)
      .map((p) => p.text)
      .join("");
  }
}
