/**
 * Server-Sent Events frames from a response's bytes, a frame per blank line.
 *
 * Follows the SSE parsing rules: `\r\n`, `\r` and `\n` end lines, a blank
 * line ends a frame, `:` starts a comment, one space after the colon is
 * dropped, several `data` lines join with `\n`. Whole chunks are split at
 * once (no per-character loop): the engine sends hundreds of frames a second.
 */

export interface Frame {
  event: string;
  data: string;
  id: string | null;
  /** The server's `retry:` field, in milliseconds. */
  retry: number | null;
}

export class FrameDecoder {
  private tail = "";
  private readonly utf8 = new TextDecoder("utf-8");

  /** The frames this chunk completes (chunks must be fed in order). */
  feed(chunk: Uint8Array): Frame[] {
    let text = this.tail + this.utf8.decode(chunk, { stream: true });
    // A final \r may be the first half of \r\n: wait for the next chunk.
    let held = "";
    if (text.endsWith("\r")) {
      text = text.slice(0, -1);
      held = "\r";
    }
    if (text.includes("\r")) text = text.replace(/\r\n?/g, "\n");
    const blocks = text.split("\n\n");
    this.tail = (blocks.pop() ?? "") + held;
    const frames: Frame[] = [];
    for (const block of blocks) {
      const frame = parseFrame(block);
      if (frame !== null) frames.push(frame);
    }
    return frames;
  }
}

function parseFrame(block: string): Frame | null {
  let event = "";
  const data: string[] = [];
  let id: string | null = null;
  let retry: number | null = null;
  for (const line of block.split("\n")) {
    if (line === "" || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const name = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (name === "data") data.push(value);
    else if (name === "event") event = value;
    else if (name === "id" && !value.includes("\0")) id = value;
    else if (name === "retry" && /^\d+$/.test(value)) retry = Number(value);
  }
  if (data.length === 0 && retry === null) return null;
  return { event: event || "message", data: data.join("\n"), id, retry };
}
