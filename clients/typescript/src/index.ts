/**
 * Holdfast's TypeScript client: typed events, a turn stream that resumes
 * itself, the HTTP API. See README.md next to this package.
 */

export {
  type ClientOptions,
  DEFAULT_STREAM_READ_TIMEOUT_MS,
  DEFAULT_URL,
  executeBody,
  HoldfastClient,
  type ReplayOptions,
  type StreamOptions,
} from "./client.js";
export {
  BAD_RESPONSE,
  CONNECTION_FAILED,
  CONNECTION_LOST,
  HoldfastError,
  isHoldfastError,
  NO_API_KEY,
} from "./errors.js";
export type * from "./generated/api.js";
export * from "./generated/events.js";
export type {
  ByteRange,
  FilesQuery,
  ListExecutionsQuery,
  ListTasksQuery,
  MemoryKind,
  MessagesQuery,
  Operations,
  UserQuery,
} from "./operations.js";
export { DEFAULT_RECONNECT, parseEvent, type Reconnect } from "./resume.js";
export { type Frame, FrameDecoder } from "./sse.js";
export { TurnStream } from "./stream.js";
export { discards, TurnText } from "./text.js";
