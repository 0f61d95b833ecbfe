/**
 * Every non-streaming operation, as a request and how to read its answer: one
 * table, which `HoldfastClient` turns into its methods (the names and the
 * routes of the Python client's `_api.py`, in camelCase). Answer types are the
 * generated ones of the gateway's OpenAPI description.
 */

import type * as api from "./generated/api.js";
import type { Call, Query } from "./transport.js";

type JsonObject = Record<string, unknown>;

const segment = encodeURIComponent;

async function json<T>(response: Response): Promise<T> {
  const text = await response.text();
  return (text ? JSON.parse(text) : {}) as T;
}

async function nothing(): Promise<void> {}

function call<T>(method: Call<T>["method"], path: string, extra: Omit<Call<T>, "method" | "path" | "read"> = {}): Call<T> {
  return { method, path, read: json<T>, ...extra };
}

function none(method: Call<void>["method"], path: string, query?: Query): Call<void> {
  return { method, path, read: nothing, query };
}

export type MemoryKind = "knowledge" | "episodes" | "social";
export type HitlAnswerBody = Omit<api.HitlAnswer, "task_id">;
export interface ListTasksQuery extends Query {
  limit?: number;
  cursor?: string;
  status?: string;
}
export interface MessagesQuery extends Query {
  branch?: string;
  after?: number;
  limit?: number;
}
export interface ListExecutionsQuery extends Query {
  status?: string;
  limit?: number;
  cursor?: string;
  offset?: number;
}
/** For the memory calls of one end user (the tenant's own memory without it). */
export interface UserQuery extends Query {
  user_id?: string;
}

export interface FilesQuery extends Query {
  path?: string;
  recursive?: boolean;
}
/** Bytes `start` to `end` (inclusive) of a file; `end` alone: its last `end` bytes. */
export interface ByteRange {
  start?: number;
  end?: number;
}

/** A workspace path as URL segments: each one encoded, the slashes kept. */
function filePath(path: string): string {
  return path.replace(/^\/+|\/+$/g, "").split("/").map(segment).join("/");
}

function rangeHeader({ start, end }: ByteRange): Record<string, string> {
  if (start === undefined && end === undefined) return {};
  return { Range: `bytes=${start ?? ""}-${end ?? ""}` };
}

async function bytes(response: Response): Promise<Uint8Array> {
  return new Uint8Array(await response.arrayBuffer());
}

function checkpointFiles(executionId: string, checkpointId: string): string {
  return `/v1/execution/${segment(executionId)}/checkpoints/${segment(checkpointId)}/files`;
}

export const operations = {
  // -- turns and HITL
  cancel: (taskId: string) =>
    call<Record<string, string>>("POST", "/execute/cancel", { json: { task_id: taskId } }),
  pending: (taskId?: string) =>
    call<api.Pending>("GET", "/hitl/pending", { query: { task_id: taskId } }),
  /** Answer a pending request: `yes`/`no` for a permission prompt, the answer to a question. */
  respond: (taskId: string, answer: string, extra: Partial<HitlAnswerBody> = {}) =>
    call<api.Resumed>("POST", "/hitl/respond", { json: { ...extra, task_id: taskId, answer } }),
  streamToken: (taskId: string) =>
    call<api.StreamToken>("POST", "/auth/stream-token", { json: { task_id: taskId } }),

  // -- tasks
  listTasks: (query: ListTasksQuery = {}) => call<api.TaskPage>("GET", "/tasks", { query }),
  getTask: (taskId: string) => call<api.TaskState>("GET", `/tasks/${segment(taskId)}`),
  taskMessages: (taskId: string, query: MessagesQuery = {}) =>
    call<api.Conversation>("GET", `/tasks/${segment(taskId)}/messages`, { query }),
  deleteTask: (taskId: string) => call<Record<string, string>>("DELETE", `/tasks/${segment(taskId)}`),
  workingMemory: (taskId: string) =>
    call<api.WorkingMemory>("GET", `/tasks/${segment(taskId)}/working-memory`),

  // -- a task's files (its workspace), and a checkpoint's
  /** A directory of the task's workspace (`path`, default the workspace; `recursive`: all below it). */
  listFiles: (taskId: string, query: FilesQuery = {}) =>
    call<api.FileList>("GET", `/tasks/${segment(taskId)}/files`, { query }),
  /** A file's bytes; `range` asks for some of them (`{ end }` alone: the last `end` bytes). */
  downloadFile: (taskId: string, path: string, range: ByteRange = {}): Call<Uint8Array> => ({
    method: "GET",
    path: `/tasks/${segment(taskId)}/files/${filePath(path)}`,
    headers: rangeHeader(range),
    read: bytes,
  }),
  /** Write the file (its directories made): between turns, or under `inputs/` while one runs. */
  uploadFile: (taskId: string, path: string, content: Uint8Array | ArrayBuffer | Blob | string) =>
    call<api.FileInfo>("PUT", `/tasks/${segment(taskId)}/files/${filePath(path)}`, {
      body: content as BodyInit,
      headers: { "Content-Type": "application/octet-stream" },
    }),
  /** Remove a file, a symlink or a directory with all it holds. */
  deleteFile: (taskId: string, path: string) =>
    none("DELETE", `/tasks/${segment(taskId)}/files/${filePath(path)}`),
  listCheckpointFiles: (executionId: string, checkpointId: string, query: FilesQuery = {}) =>
    call<api.FileList>("GET", checkpointFiles(executionId, checkpointId), { query }),
  downloadCheckpointFile: (
    executionId: string,
    checkpointId: string,
    path: string,
    range: ByteRange = {},
  ): Call<Uint8Array> => ({
    method: "GET",
    path: `${checkpointFiles(executionId, checkpointId)}/${filePath(path)}`,
    headers: rangeHeader(range),
    read: bytes,
  }),

  // -- agents, skills, assets
  listAgents: () => call<api.AgentList>("GET", "/agents"),
  getAgent: (name: string) => call<api.Agent>("GET", `/agents/${segment(name)}`),
  createAgent: (spec: api.NewAgent) => call<api.Agent>("POST", "/agents", { json: spec }),
  replaceAgent: (name: string, spec: api.AgentSpec) =>
    call<api.Agent>("PUT", `/agents/${segment(name)}`, { json: spec }),
  deleteAgent: (name: string) => none("DELETE", `/agents/${segment(name)}`),
  listSkills: () => call<api.SkillList>("GET", "/skills"),
  getSkill: (name: string) => call<api.SkillOut>("GET", `/skills/${segment(name)}`),
  /** A skill as JSON, or as the bytes of a zip archive. */
  createSkill: (skill: JsonObject | Uint8Array | ArrayBuffer) =>
    skill instanceof Uint8Array || skill instanceof ArrayBuffer
      ? call<api.SkillOut>("POST", "/skills", { body: skill as BodyInit, headers: { "Content-Type": "application/zip" } })
      : call<api.SkillOut>("POST", "/skills", { json: skill }),
  deleteSkill: (name: string) => none("DELETE", `/skills/${segment(name)}`),
  listServers: () => call<api.ServerList>("GET", "/assets/servers"),
  getServer: (name: string) => call<api.Server>("GET", `/assets/servers/${segment(name)}`),
  serverTools: (name: string) => call<api.ServerTools>("GET", `/assets/servers/${segment(name)}/tools`),
  registerServer: (spec: JsonObject) => call<api.Server>("POST", "/assets/servers", { json: spec }),
  deleteServer: (name: string) => none("DELETE", `/assets/servers/${segment(name)}`),
  connectServer: (name: string) => call<api.Connect>("GET", `/assets/servers/${segment(name)}/connect`),

  // -- memory and learning
  searchMemory: (kind: MemoryKind, q: string, query: UserQuery & { limit?: number } = {}) =>
    call<api.SearchResults>("GET", `/memory/${segment(kind)}/search`, { query: { ...query, q } }),
  saveFact: (fact: api.NewFact) => call<api.SavedFact>("POST", "/memory/knowledge", { json: fact }),
  getFact: (factId: string, query: UserQuery = {}) =>
    call<api.FactWithHistory>("GET", `/memory/knowledge/${segment(factId)}`, { query }),
  deleteFact: (factId: string, query: UserQuery = {}) =>
    none("DELETE", `/memory/knowledge/${segment(factId)}`, query),
  getSoul: (query: UserQuery = {}) => call<api.Soul>("GET", "/memory/soul", { query }),
  putSoul: (soul: api.NewSoul) => call<api.Soul>("PUT", "/memory/soul", { json: soul }),
  soulVersions: (query: UserQuery = {}) => call<api.SoulVersions>("GET", "/memory/soul/versions", { query }),
  /** The memory as NDJSON, one record a line. */
  exportMemory: (query: UserQuery = {}): Call<string> => ({
    method: "GET",
    path: "/memory/export",
    query,
    read: (response) => response.text(),
  }),
  importMemory: (ndjson: string, query: UserQuery = {}) =>
    call<api.Imported>("POST", "/memory/import", {
      query,
      body: ndjson,
      headers: { "Content-Type": "application/x-ndjson" },
    }),
  forgetMemory: (query: UserQuery = {}) => call<api.Forgotten>("DELETE", "/memory", { query }),
  learningStatus: () => call<api.LearningStatus>("GET", "/learning/status"),
  health: () => call<api.Health>("GET", "/health"),

  // -- executions (/v1/execution)
  createExecution: (spec: api.CreateExecution) =>
    call<api.ExecutionOut>("POST", "/v1/execution", { json: spec }),
  getExecution: (id: string) => call<api.ExecutionOut>("GET", `/v1/execution/${segment(id)}`),
  listExecutions: (query: ListExecutionsQuery = {}) =>
    call<api.ExecutionPage>("GET", "/v1/execution", { query }),
  checkpointExecution: (id: string, checkpoint: api.SaveCheckpoint = {}) =>
    call<api.CheckpointOut>("PUT", `/v1/execution/${segment(id)}/checkpoint`, { json: checkpoint }),
  pauseExecution: (id: string) => call<api.ExecutionOut>("POST", `/v1/execution/${segment(id)}/pause`),
  resumeExecution: (id: string, checkpointId?: string) =>
    call<api.ExecutionOut>("POST", `/v1/execution/${segment(id)}/resume`, {
      json: checkpointId === undefined ? {} : { checkpoint_id: checkpointId },
    }),
  deleteExecution: (id: string) => none("DELETE", `/v1/execution/${segment(id)}`),
} satisfies Record<string, (...args: never[]) => Call<unknown>>;

type Table = typeof operations;
type Answer<C> = C extends Call<infer T> ? T : never;

/** The client's methods: each operation's arguments; its answer. */
export type Operations = {
  [K in keyof Table]: (...args: Parameters<Table[K]>) => Promise<Answer<ReturnType<Table[K]>>>;
};
