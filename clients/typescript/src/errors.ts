/** One error type for everything the engine (or the way to it) refuses. */

import type { ErrorBody } from "./generated/api.js";

/** Codes of failures the client itself detects (no JSON error body to read). */
export const CONNECTION_LOST = "CONNECTION_LOST";
export const CONNECTION_FAILED = "CONNECTION_FAILED";
export const BAD_RESPONSE = "BAD_RESPONSE";
export const NO_API_KEY = "NO_API_KEY";

/**
 * An error answer of the engine, or a connection the client gave up on.
 *
 * `status` is the HTTP status (null when no answer came), `code` the
 * machine-readable `error` of the JSON body (`TASK_NOT_FOUND`,
 * `TURN_IN_PROGRESS`, `INVALID_REQUEST`, ...; `CONNECTION_LOST` when a stream
 * stopped reconnecting), `details` what the body added (`details.errors`
 * names each invalid field), `retryAfter` the `Retry-After` header in seconds.
 */
export class HoldfastError extends Error {
  override readonly name = "HoldfastError";

  constructor(
    readonly status: number | null,
    readonly code: string,
    message: string,
    readonly details: Record<string, unknown> = {},
    readonly retryAfter: number | null = null,
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }

  /** The error a non-2xx response stands for (its body read already). */
  static fromResponse(response: Response, body: string): HoldfastError {
    const envelope = parseEnvelope(body);
    const retryAfter = seconds(response.headers.get("Retry-After"));
    if (envelope) {
      return new HoldfastError(
        response.status,
        envelope.error,
        envelope.message,
        envelope.details ?? {},
        retryAfter,
      );
    }
    // Not the engine's answer (a proxy's page, say): keep a bounded excerpt.
    const excerpt = body.slice(0, 500) || response.statusText;
    return new HoldfastError(response.status, `HTTP_${response.status}`, excerpt, {}, retryAfter);
  }

  override toString(): string {
    const status = this.status === null ? "" : `${this.status} `;
    return `${this.name}: ${status}${this.code}: ${this.message}`;
  }
}

/** Whether `error` is a {@link HoldfastError}, of `code` when given. */
export function isHoldfastError(error: unknown, code?: string): error is HoldfastError {
  return error instanceof HoldfastError && (code === undefined || error.code === code);
}

function parseEnvelope(body: string): ErrorBody | null {
  let parsed: unknown;
  try {
    parsed = JSON.parse(body);
  } catch {
    return null;
  }
  if (typeof parsed !== "object" || parsed === null) return null;
  const { error, message, details } = parsed as Record<string, unknown>;
  if (typeof error !== "string") return null;
  return {
    error,
    message: typeof message === "string" ? message : "",
    details: typeof details === "object" && details !== null ? (details as ErrorBody["details"]) : {},
  };
}

function seconds(value: string | null): number | null {
  if (value === null) return null;
  const parsed = Number(value);
  return Number.isFinite(parsed) ? parsed : null;
}
