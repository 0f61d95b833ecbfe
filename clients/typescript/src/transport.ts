/** How requests reach the engine: the base URL, the key, `fetch`, timeouts. */

import { CONNECTION_FAILED, HoldfastError } from "./errors.js";

export type Query = Record<string, string | number | boolean | null | undefined>;

/** One request: what to send, and how to read a 2xx answer. */
export interface Call<T> {
  method: "GET" | "POST" | "PUT" | "DELETE";
  path: string;
  read: (response: Response) => Promise<T>;
  query?: Query;
  json?: unknown;
  body?: BodyInit;
  headers?: Record<string, string>;
}

export interface TransportOptions {
  baseUrl: string;
  apiKey: string;
  fetch: typeof fetch;
  /** A non-streaming request's limit, in milliseconds. */
  timeoutMs: number;
}

export class Transport {
  constructor(readonly options: TransportOptions) {}

  url(path: string, query: Query = {}): string {
    const url = new URL(this.options.baseUrl.replace(/\/+$/, "") + path);
    for (const [name, value] of Object.entries(query)) {
      if (value !== null && value !== undefined) url.searchParams.set(name, String(value));
    }
    return url.toString();
  }

  /** `fetch` with the key, and a JSON body when `json` is given. */
  fetch(
    method: string,
    url: string,
    init: { json?: unknown; body?: BodyInit; headers?: Record<string, string>; signal?: AbortSignal },
  ): Promise<Response> {
    const headers: Record<string, string> = { "X-Engine-Key": this.options.apiKey, ...init.headers };
    let body = init.body;
    if (init.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(init.json);
    }
    return this.options.fetch(url, { method, headers, body, signal: init.signal });
  }

  /** Send `call`; its answer read, or a {@link HoldfastError}. */
  async send<T>(call: Call<T>, signal?: AbortSignal): Promise<T> {
    const timeout = AbortSignal.timeout(this.options.timeoutMs);
    const both = signal ? anySignal([signal, timeout]) : timeout;
    let response: Response;
    try {
      response = await this.fetch(call.method, this.url(call.path, call.query), {
        json: call.json,
        body: call.body,
        headers: call.headers,
        signal: both,
      });
      if (response.status >= 400) {
        throw HoldfastError.fromResponse(response, await response.text());
      }
      return await call.read(response);
    } catch (error) {
      if (error instanceof HoldfastError || signal?.aborted) throw error;
      throw new HoldfastError(null, CONNECTION_FAILED, String(error), {}, null, { cause: error });
    }
  }
}

/** A signal aborted when any of `signals` is (`AbortSignal.any` is Node ≥ 20). */
export function anySignal(signals: AbortSignal[]): AbortSignal {
  const controller = new AbortController();
  for (const signal of signals) {
    if (signal.aborted) {
      controller.abort(signal.reason);
      break;
    }
    signal.addEventListener("abort", () => controller.abort(signal.reason), {
      once: true,
      signal: controller.signal,
    });
  }
  return controller.signal;
}
