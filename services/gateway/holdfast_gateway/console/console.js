// The Holdfast web console: no framework, no build. Everything shown comes
// from the API and is rendered with textContent (never innerHTML), so model
// output is text, whatever it contains; the gateway's CSP backs that up.
//
// Opening a task reads its history with one fetch of GET /execute/replay
// (the key in its header, the body parsed here as it streams): Chromium's
// EventSource dispatches each event as a task of its own and takes over a
// second for 10,000 of them, where this takes about a quarter of that. From
// the last seq shown, the browser's own EventSource follows the task live,
// on GET /execute/replay?follow=task&token=<stream token>: the token (POST
// /auth/stream-token) stands in for the API key, which must never go in a
// URL. follow=task keeps that one connection open while the task is idle
// and through every later turn, whoever starts it (this page, `holdfast
// chat`, an on_busy message); a stream that ended with each turn had an
// idle task's page reopen it every few seconds, reading "reconnecting…".
// The server ends a follow after the token's TTL; the browser reconnects by
// itself with Last-Event-ID, the server refuses the expired token, and the
// page asks for a new one and goes on from the last seq it shows. Every seq
// is shown once: older ones are skipped, whichever way they came.
//
// The task's status uses the words of GET /tasks (idle, running, waiting,
// paused), in the badge and in the list alike. A turn's own ending is a note
// in its transcript. The user's messages are not events (a turn's `started`
// carries no text): they come from GET /tasks/{id}/messages, or, for one
// sent from this page, from what was typed; messages steered into a running
// turn arrive as user_message events.
'use strict';

const KEY_STORAGE = 'holdfast.key';
const RECENT_STORAGE = 'holdfast.recent-tasks';
const EVENT_TYPES = [
  'thread_lifecycle', 'error', 'text_delta', 'thinking_delta', 'content_block_start',
  'content_block_stop', 'tool_call', 'tool_result', 'hitl_request', 'hitl_resolved',
  'working_memory_update', 'compaction_event', 'turn_resumed', 'usage', 'user_message',
  'subagent_started', 'subagent_completed',
];
const PREVIEW_CHARS = 160;

// What the page holds; window.hfConsole exposes it read-only for tests and benches.
const view = {
  key: null,
  taskId: null,
  source: null,        // the EventSource of the open task
  history: null,       // the AbortController of the history fetch, while it runs
  lastSeq: 0,          // the highest seq shown
  seqs: [],            // every seq shown, in order
  turn: null,          // {id, li, block, blocks} of the turn being drawn
  toolCalls: new Map(),  // tool_call_id -> the element its result goes into
  prompts: new Map(),    // request_id -> prompt element
  reconnectTimer: null,
  generation: 0,       // bumps when another task opens: late callbacks of the old one stop
  status: '',          // the open task's status, in GET /tasks's words
  statusChanges: 0,    // bumps with every event that sets the status
  asked: new Map(),    // turn_id -> the text of the user's message that started it
  turns: new Map(),    // turn_id -> its drawn turn, for a message that arrives later
  messagesAfter: 0,    // the last message id read from GET /tasks/{id}/messages
  messagesLoading: null,  // the Promise of that read, while it runs
};
window.hfConsole = {
  get seqs() { return view.seqs.slice(); },
  get lastSeq() { return view.lastSeq; },
  get taskId() { return view.taskId; },
  get connected() { return view.source !== null && view.source.readyState === EventSource.OPEN; },
  get status() { return view.status; },
};

const $ = (id) => document.getElementById(id);

function el(tag, className, ...children) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function preview(value) {
  const text = typeof value === 'string' ? value : JSON.stringify(value);
  if (text === undefined) return '';
  return text.length > PREVIEW_CHARS ? text.slice(0, PREVIEW_CHARS) + '…' : text;
}

function pretty(value) {
  return typeof value === 'string' ? value : JSON.stringify(value, null, 2);
}

// ---- API -------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function api(method, path, body, { signal } = {}) {
  const headers = { 'X-Engine-Key': view.key };
  const init = { method, headers, signal };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) {
    let code = `HTTP_${response.status}`;
    let message = response.statusText;
    try {
      const error = await response.json();
      code = error.error || code;
      message = error.message || message;
    } catch (_) { /* not a JSON error body */ }
    if (response.status === 401 && code === 'INVALID_KEY') signOut('The key was refused: ' + message);
    throw new ApiError(response.status, code, message);
  }
  return response;
}

async function apiJson(method, path, body) {
  return (await api(method, path, body)).json();
}

// ---- sign in ---------------------------------------------------------------

async function signIn(key, { remembered = false } = {}) {
  view.key = key;
  const wanted = new URLSearchParams(location.hash.slice(1)).get('task');
  if (remembered) {
    // A key this tab already signed in with: show the task at once; a
    // refused key still signs out (api() on INVALID_KEY).
    showApp();
    if (wanted) openTask(wanted);
    await loadTasks();
    return;
  }
  // Any authenticated read tells a valid key from a refused one.
  await apiJson('GET', '/agents');
  sessionStorage.setItem(KEY_STORAGE, key);
  showApp();
  await loadTasks();
  if (wanted) openTask(wanted);
}

function showApp() {
  $('sign-in').hidden = true;
  $('app').hidden = false;
  $('tabs').hidden = false;
  $('sign-out').hidden = false;
}

function signOut(message) {
  closeStream();
  view.key = null;
  sessionStorage.removeItem(KEY_STORAGE);
  $('app').hidden = true;
  $('tabs').hidden = true;
  $('sign-out').hidden = true;
  $('sign-in').hidden = false;
  const error = $('sign-in-error');
  error.textContent = message || '';
  error.hidden = !message;
}

// ---- tasks -----------------------------------------------------------------

function recentTasks() {
  try {
    const list = JSON.parse(sessionStorage.getItem(RECENT_STORAGE) || '[]');
    return Array.isArray(list) ? list.filter((name) => typeof name === 'string') : [];
  } catch (_) {
    return [];
  }
}

function remember(taskId) {
  const list = [taskId, ...recentTasks().filter((name) => name !== taskId)].slice(0, 50);
  sessionStorage.setItem(RECENT_STORAGE, JSON.stringify(list));
}

function taskRows(body) {
  const rows = Array.isArray(body) ? body : (body && (body.tasks || body.items)) || [];
  return rows.map((row) => ({
    id: String(row.task_id ?? row.name ?? row.id ?? ''),
    status: row.status ? String(row.status) : '',
  })).filter((row) => row.id);
}

async function loadTasks() {
  const note = $('tasks-note');
  let rows;
  try {
    rows = taskRows(await apiJson('GET', '/tasks'));
    note.textContent = '';
  } catch (error) {
    if (error.status === 401) throw error;
    // A gateway without GET /tasks (or one failing): the tasks opened in this tab.
    rows = recentTasks().map((id) => ({ id, status: '' }));
    note.textContent = error.status === 404 || error.status === 405
      ? 'This gateway does not list tasks; showing the ones opened here.'
      : `Could not list tasks (${error.code}); showing the ones opened here.`;
  }
  const list = $('task-list');
  list.replaceChildren(...rows.map((row) => {
    const item = el('li', row.id === view.taskId ? 'open' : '', el('span', 'mono', row.id));
    // The open task's status is the page's freshest: the list is read once.
    const status = row.id === view.taskId && view.status ? view.status : row.status;
    if (status) item.append(el('span', `badge ${status}`, status));
    item.dataset.task = row.id;
    item.title = row.id;
    item.addEventListener('click', () => openTask(row.id));
    return item;
  }));
}

// GET /tasks's words (taskstatus.py): idle, running, waiting, paused.
function setStatus(status) {
  view.status = status;
  const badge = $('task-status');
  badge.textContent = status;
  badge.className = `badge ${status}`;
  const row = view.taskId && [...$('task-list').children].find((item) => item.dataset.task === view.taskId);
  if (!row || !status) return;
  let rowBadge = row.querySelector('.badge');
  if (!rowBadge) row.append(rowBadge = el('span', 'badge'));
  rowBadge.textContent = status;
  rowBadge.className = `badge ${status}`;
}

// An event's word for the task's status, counted so that a status read
// (GET /tasks/{id}) answered after a newer event does not undo it.
function statusFromEvent(status) {
  view.statusChanges += 1;
  setStatus(status);
}

async function readStatus(generation) {
  const changes = view.statusChanges;
  try {
    const task = await apiJson('GET', '/tasks/' + encodeURIComponent(view.taskId));
    if (generation === view.generation && changes === view.statusChanges && task.status) {
      setStatus(String(task.status));
    }
  } catch (_) { /* a gateway without GET /tasks/{id}: the events' word stands */ }
}

// ---- the open task's stream -------------------------------------------------

function closeStream() {
  if (view.history) view.history.abort();
  view.history = null;
  if (view.source) view.source.close();
  view.source = null;
  clearTimeout(view.reconnectTimer);
  view.reconnectTimer = null;
}

function openTask(taskId) {
  closeStream();
  view.generation += 1;
  view.taskId = taskId;
  view.lastSeq = 0;
  view.seqs = [];
  view.turn = null;
  view.toolCalls.clear();
  view.prompts.clear();
  resetMessages();
  dirtyBlocks.clear();
  $('transcript').replaceChildren();
  $('hitl').replaceChildren();
  $('task-title').textContent = taskId;
  setStatus('');
  remember(taskId);
  history.replaceState(null, '', '#task=' + encodeURIComponent(taskId));
  for (const item of $('task-list').children) item.classList.toggle('open', item.dataset.task === taskId);
  loadMessages(view.generation);
  loadHistory();
}

function resetMessages() {
  view.asked.clear();
  view.turns.clear();
  view.messagesAfter = 0;
  view.messagesLoading = null;
}

const FRAME_END = /\r?\n\r?\n/;

// The task's stored events in one response, then connect() from the last one.
async function loadHistory() {
  const generation = view.generation;
  const controller = new AbortController();
  view.history = controller;
  $('stream-status').textContent = 'loading…';
  performance.mark('hf-history-asked');
  try {
    const params = new URLSearchParams({ task_id: view.taskId, after_seq: String(view.lastSeq) });
    const response = await api('GET', '/execute/replay?' + params, undefined, {
      signal: controller.signal,
    });
    $('stream-status').textContent = 'live';
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done || generation !== view.generation) break;
      buffer += value;
      const frames = buffer.split(FRAME_END);
      buffer = frames.pop();
      for (const frame of frames) receiveFrame(frame, generation);
    }
  } catch (error) {
    if (generation !== view.generation || controller.signal.aborted) return;
    if (error.status === 404) {
      $('stream-status').textContent = `${error.code}: ${error.message}`;
      return;
    }
    // A dropped connection or a refusal: the EventSource goes on from the last seq.
  } finally {
    if (view.history === controller) view.history = null;
  }
  if (generation !== view.generation) return;
  // The events replayed say what the task did; GET /tasks/{id} says what it
  // does now (a turn paused by the execution API, a message queued).
  readStatus(generation);
  connect();
}

// One SSE frame of the engine's (event, id, data lines); heartbeats carry no id.
function receiveFrame(frame, generation) {
  let id = '';
  let data = '';
  for (const line of frame.split(/\r?\n/)) {
    if (line.startsWith('id:')) id = line.slice(line[3] === ' ' ? 4 : 3);
    else if (line.startsWith('data:')) data += (data ? '\n' : '') + line.slice(line[5] === ' ' ? 6 : 5);
  }
  if (id && data) receive({ lastEventId: id, data }, generation);
}

async function connect() {
  const generation = view.generation;
  clearTimeout(view.reconnectTimer);
  $('stream-status').textContent = 'connecting…';
  let token;
  performance.mark('hf-token-asked');
  try {
    token = await apiJson('POST', '/auth/stream-token', { task_id: view.taskId });
  } catch (error) {
    if (generation !== view.generation) return;
    $('stream-status').textContent = `${error.code}: ${error.message}`;
    if (error.status === 404) return;  // no such task (yet): nothing to follow
    view.reconnectTimer = setTimeout(connect, 2000);
    return;
  }
  if (generation !== view.generation) return;
  const params = new URLSearchParams({
    task_id: view.taskId, after_seq: String(view.lastSeq), follow: 'task', token: token.token,
  });
  performance.mark('hf-replay-opened');
  const source = new EventSource('/execute/replay?' + params);
  view.source = source;
  const onEvent = (message) => receive(message, generation);
  for (const type of EVENT_TYPES) source.addEventListener(type, onEvent);
  source.onopen = () => { $('stream-status').textContent = 'live'; };
  source.onerror = () => {
    if (source.readyState === EventSource.CLOSED && generation === view.generation) {
      // Refused (say the token expired, or a gateway restarting answered
      // 503): a new token, from the last seq shown.
      source.close();
      view.source = null;
      $('stream-status').textContent = 'reconnecting…';
      view.reconnectTimer = setTimeout(connect, 1000);
    } else {
      $('stream-status').textContent = 'reconnecting…';
    }
  };
}

function receive(message, generation) {
  if (generation !== view.generation) return;
  const seq = Number(message.lastEventId);
  if (!(seq > view.lastSeq)) return;  // already shown: a resend after a reconnect
  let event;
  try {
    event = JSON.parse(message.data);
  } catch (_) {
    return;
  }
  if (view.lastSeq === 0) performance.mark('hf-first-event');
  view.lastSeq = seq;
  view.seqs.push(seq);
  render(event, seq);
}

// The open connection follows every turn of the task; without one (between
// retries, or refused), reconnect now rather than at the browser's next
// retry: a turn we started should stream at once.
function follow() {
  if (view.source && view.source.readyState === EventSource.OPEN) return;
  if (view.history) return;  // the history read is still streaming; connect() follows it
  closeStream();
  connect();
}

// ---- the user's messages ------------------------------------------------------

// The text of a stored user message (content.blocks, as the engine stores it);
// null for the tool results that also travel as user messages.
function messageText(message) {
  if (message.role !== 'user' || message.position !== 0) return null;
  const content = message.content || {};
  const texts = (content.blocks || []).filter((block) => block.type === 'text').map((block) => block.text);
  if (!texts.length) return null;
  const media = (content.media || []).length;
  return texts.join('\n') + (media ? ` (+${media} attachment${media > 1 ? 's' : ''})` : '');
}

// Every turn's opening message, all branches (the log holds forked-off turns
// too), from the last one read; again when a turn starts whose message is new.
function loadMessages(generation) {
  if (view.messagesLoading) return view.messagesLoading;
  const task = view.taskId;
  const run = (async () => {
    try {
      for (;;) {
        const params = new URLSearchParams({ branch: 'all', after: String(view.messagesAfter), limit: '1000' });
        const page = await apiJson('GET', `/tasks/${encodeURIComponent(task)}/messages?${params}`);
        if (generation !== view.generation) return;
        for (const message of page.messages || []) {
          view.messagesAfter = Math.max(view.messagesAfter, message.id);
          const text = messageText(message);
          if (text !== null && !view.asked.has(message.turn_id)) showAsked(message.turn_id, text);
        }
        if (page.next_after == null) return;
      }
    } catch (_) {
      // No such task yet, or a gateway without it: the typed messages still show.
    } finally {
      if (generation === view.generation) view.messagesLoading = null;
    }
  })();
  view.messagesLoading = run;
  return run;
}

// The user's message at the top of its turn, once, whenever either arrives first.
function showAsked(turnId, text) {
  if (view.asked.has(turnId)) return;
  view.asked.set(turnId, text);
  const turn = view.turns.get(turnId);
  if (turn) turn.head.after(el('div', 'user', text));
}

// ---- rendering --------------------------------------------------------------

function line(className, ...children) {
  const item = el('li', className, ...children);
  $('transcript').append(item);
  return item;
}

function turnFor(event) {
  if (view.turn && view.turn.id === event.turn_id) return view.turn;
  flushText();
  const head = el('div', 'turn-head', `turn ${event.turn_id || ''}`);
  const li = line('turn', head);
  view.turn = { id: event.turn_id, li, head, block: null, blocks: [] };
  if (event.turn_id) {
    view.turns.set(event.turn_id, view.turn);
    const asked = view.asked.get(event.turn_id);
    if (asked !== undefined) head.after(el('div', 'user', asked));
    else if (!view.history) loadMessages(view.generation);  // a turn started live, elsewhere
  }
  return view.turn;
}

// Text and thinking deltas: one Text node per block, written at most once a
// frame (10,000 deltas as 10,000 nodes, or 10,000 writes, cost more to lay
// out than all the rest). Each block keeps its deltas by seq until its turn
// ends, for turn_resumed's discards.
const dirtyBlocks = new Set();
let flushPending = false;

function appendDelta(event, seq, kind) {
  const turn = turnFor(event);
  if (!turn.block || turn.block.kind !== kind) {
    const text = document.createTextNode('');
    turn.li.append(el('div', kind, text));
    turn.block = { kind, text, parts: [], pending: '' };
    turn.blocks.push(turn.block);
  }
  const part = event.text || '';
  turn.block.parts.push([seq, part]);
  turn.block.pending += part;
  dirtyBlocks.add(turn.block);
  if (!flushPending) {
    flushPending = true;
    requestAnimationFrame(flushText);
  }
}

function flushText() {
  flushPending = false;
  for (const block of dirtyBlocks) {
    block.text.appendData(block.pending);
    block.pending = '';
  }
  dirtyBlocks.clear();
}

function render(event, seq) {
  if (event.subagent) {
    // A subagent's child task streams in its parent's log: one note each way
    // here (the child's own work is on its task's page); its question is
    // answered through the parent, so it is shown as this task's.
    const who = `${event.subagent.agent} (${event.subagent.task_id})`;
    if (event.type === 'subagent_started') {
      turnFor(event).li.append(el('div', 'note', `delegated to ${who}: ${preview(event.brief)}`));
    } else if (event.type === 'subagent_completed') {
      turnFor(event).li.append(el('div', 'note', `${who} ${event.status}: ${preview(event.answer)}`));
    } else if (event.type === 'hitl_request') {
      renderPrompt(event);
    } else if (event.type === 'hitl_resolved') {
      const prompt = view.prompts.get(event.request_id);
      if (prompt) prompt.remove();
      view.prompts.delete(event.request_id);
    }
    return;
  }
  switch (event.type) {
    case 'thread_lifecycle': {
      const turn = turnFor(event);
      turn.block = null;
      if (event.phase === 'started') {
        statusFromEvent('running');
      } else {
        flushText();
        statusFromEvent('idle');
        const reason = event.stop_reason ? ` (${event.stop_reason})` : '';
        turn.li.append(el('div', 'note', `turn ${event.phase}${reason}`));
        turn.blocks = [];  // no discard reaches a finished turn
        for (const prompt of view.prompts.values()) prompt.remove();
        view.prompts.clear();
      }
      break;
    }
    case 'text_delta':
      appendDelta(event, seq, 'text');
      break;
    case 'thinking_delta':
      appendDelta(event, seq, 'thinking');
      break;
    case 'content_block_start':
    case 'content_block_stop':
      turnFor(event).block = null;
      break;
    case 'tool_call':
      renderToolCall(event);
      break;
    case 'tool_result':
      renderToolResult(event);
      break;
    case 'hitl_request':
      renderPrompt(event);
      break;
    case 'hitl_resolved': {
      const prompt = view.prompts.get(event.request_id);
      if (prompt) prompt.remove();
      view.prompts.delete(event.request_id);
      turnFor(event).li.append(el('div', 'note', `answered: ${preview(event.answer ?? '')}`));
      statusFromEvent('running');
      break;
    }
    case 'user_message': {
      const turn = turnFor(event);
      turn.block = null;
      if (event.applied === 'next_turn') {
        // The message that started this turn (after the one it was sent to ended).
        showAsked(event.turn_id, event.text);
      } else {
        turn.li.append(el('div', 'user', event.text));
      }
      break;
    }
    case 'turn_resumed': {
      const turn = turnFor(event);
      const from = event.discard_from_seq;
      const to = event.discard_to_seq;
      if (from != null && to != null) {
        // The cut-off step's output is run again: drop what it had streamed.
        for (const block of turn.blocks) {
          const kept = block.parts.filter(([deltaSeq]) => deltaSeq < from || deltaSeq > to);
          if (kept.length === block.parts.length) continue;
          block.parts = kept;
          block.text.data = kept.map(([, part]) => part).join('');
          block.pending = '';
          dirtyBlocks.delete(block);
        }
      }
      turn.block = null;
      turn.li.append(el('div', 'note', `resumed (${event.reason || 'restart'})`));
      break;
    }
    case 'error':
      turnFor(event).li.append(el('div', 'ev-error', `${event.error}: ${event.message}`));
      break;
    case 'working_memory_update':
      turnFor(event).li.append(
        el('div', 'note', `working memory: ${event.key} = ${preview(event.value ?? '(deleted)')}`));
      break;
    case 'compaction_event':
      turnFor(event).li.append(
        el('div', 'note', `compacted ${event.summarized_messages} messages`));
      break;
    default:
      break;  // usage and types this console does not know: counted, not drawn
  }
}

function renderToolCall(event) {
  const turn = turnFor(event);
  turn.block = null;
  const result = el('span', 'muted', ' …');
  const details = el('details', 'tool',
    el('summary', '', el('span', 'name', event.tool), `(${preview(event.input)})`, result),
    el('pre', '', pretty(event.input)));
  turn.li.append(details);
  view.toolCalls.set(event.tool_call_id, { details, result });
}

function renderToolResult(event) {
  const call = view.toolCalls.get(event.tool_call_id);
  const failed = event.error != null;
  const summary = failed ? ` ✗ ${preview(event.error)}` : ` → ${preview(event.output)}`;
  if (call) {
    call.result.className = failed ? 'err' : 'ok';
    call.result.textContent = summary;
    call.details.append(el('pre', '', pretty(failed ? event.error : event.output)));
  } else {
    turnFor(event).li.append(el('div', 'tool', summary));
  }
}

function renderPrompt(event) {
  if (view.prompts.has(event.request_id)) return;
  statusFromEvent('waiting');
  const prompt = el('div', 'prompt', el('div', 'q', event.question));
  prompt.dataset.request = event.request_id;
  const status = el('span', 'muted');
  const answer = async (text) => {
    for (const button of prompt.querySelectorAll('button')) button.disabled = true;
    try {
      await apiJson('POST', '/hitl/respond', {
        task_id: view.taskId, request_id: event.request_id, answer: text,
      });
      status.textContent = 'sent';
      follow();
    } catch (error) {
      status.textContent = `${error.code}: ${error.message}`;
      if (error.status === 409 || error.status === 410) return;  // settled elsewhere
      for (const button of prompt.querySelectorAll('button')) button.disabled = false;
    }
  };
  if (event.kind === 'permission') {
    const allow = el('button', 'allow', 'Allow');
    const deny = el('button', 'deny', 'Deny');
    allow.type = deny.type = 'button';
    allow.addEventListener('click', () => answer('yes'));
    deny.addEventListener('click', () => answer('no'));
    prompt.append(allow, deny, status);
  } else {
    const input = el('input', 'answer');
    const send = el('button', 'send', 'Answer');
    send.type = 'button';
    send.addEventListener('click', () => input.value.trim() && answer(input.value));
    prompt.append(input, send, status);
  }
  $('hitl').append(prompt);
  view.prompts.set(event.request_id, prompt);
  turnFor(event).li.append(el('div', 'note', `asked (${event.kind}): ${preview(event.question)}`));
}

// ---- sending ---------------------------------------------------------------

async function send(message, agent) {
  const body = { message };
  if (view.taskId) body.task_id = view.taskId;
  if (agent) body.agent = agent;
  const error = $('send-error');
  error.hidden = true;
  // The turn streams in POST /execute's response too; this page follows it
  // through the task's EventSource instead, so it stops reading once the
  // turn has started (X-Task-Id). Closing the response does not stop a turn.
  const controller = new AbortController();
  try {
    const response = await api('POST', '/execute', body, { signal: controller.signal });
    const taskId = response.headers.get('X-Task-Id');
    const turnId = response.headers.get('X-Turn-Id');
    controller.abort();
    if (taskId && taskId !== view.taskId) {
      openTask(taskId);
      if (turnId) showAsked(turnId, message);
      loadTasks().catch(() => {});
    } else {
      if (turnId) showAsked(turnId, message);
      follow();
    }
    return true;
  } catch (failure) {
    error.textContent = `${failure.code || 'ERROR'}: ${failure.message}`;
    error.hidden = false;
    return false;
  }
}

// ---- the other tabs ---------------------------------------------------------

function cells(...values) {
  return el('tr', '', ...values.map((value) => el('td', '', value instanceof Node ? value : String(value ?? ''))));
}

async function loadMemory() {
  const user = $('memory-user').value.trim();
  const query = user ? '?user_id=' + encodeURIComponent(user) : '';
  const note = $('memory-note');
  try {
    const soul = await apiJson('GET', '/memory/soul' + query);
    $('soul').textContent = soul.version ? soul.content : '(no soul yet)';
    const text = await (await api('GET', '/memory/export' + query)).text();
    const rows = [];
    for (const raw of text.split('\n')) {
      if (!raw.trim()) continue;
      const row = JSON.parse(raw);
      const kind = row.kind || row.type || '';
      if (kind === 'soul' || kind === 'header') continue;
      const data = row.data || row;
      rows.push(cells(kind, preview(data.text ?? data.summary ?? data.name ?? data.content ?? data)));
      if (rows.length >= 500) break;
    }
    $('memory-table').tBodies[0].replaceChildren(...rows);
    note.textContent = rows.length ? '' : 'Nothing learned yet.';
  } catch (error) {
    note.textContent = `${error.code || 'ERROR'}: ${error.message}`;
  }
}

async function loadAgents() {
  const body = await apiJson('GET', '/agents');
  $('agents-table').tBodies[0].replaceChildren(...body.agents.map((agent) => cells(
    agent.name, agent.description, agent.model || '(default)', (agent.tools || []).join(', '),
    agent.builtin ? 'built-in' : 'custom')));
}

async function loadExecutions() {
  const note = $('executions-note');
  try {
    const body = await apiJson('GET', '/v1/execution');
    const rows = Array.isArray(body) ? body : body.executions || body.items || [];
    $('executions-table').tBodies[0].replaceChildren(...rows.map((row) => cells(
      row.execution_id ?? row.id ?? '', row.status ?? '', preview(row))));
    note.textContent = rows.length ? '' : 'No executions.';
  } catch (error) {
    $('executions-table').tBodies[0].replaceChildren();
    note.textContent = error.status === 404 || error.status === 405
      ? 'This gateway does not offer executions (/v1/execution).'
      : `${error.code}: ${error.message}`;
  }
}

const LOADERS = { tasks: loadTasks, memory: loadMemory, agents: loadAgents, executions: loadExecutions };

function showTab(name) {
  for (const button of $('tabs').querySelectorAll('button')) {
    button.classList.toggle('active', button.dataset.tab === name);
  }
  for (const tab of Object.keys(LOADERS)) $('tab-' + tab).hidden = tab !== name;
  LOADERS[name]().catch((error) => console.warn('loading', name, error));
}

// ---- wiring -----------------------------------------------------------------

function start() {
  $('sign-in-form').addEventListener('submit', (event) => {
    event.preventDefault();
    const key = $('key-input').value.trim();
    $('key-input').value = '';
    signIn(key).catch((error) => signOut(`${error.code || 'ERROR'}: ${error.message}`));
  });
  $('sign-out').addEventListener('click', () => signOut());
  for (const button of $('tabs').querySelectorAll('button')) {
    button.addEventListener('click', () => showTab(button.dataset.tab));
  }
  $('open-form').addEventListener('submit', (event) => {
    event.preventDefault();
    const name = $('open-input').value.trim();
    if (name) openTask(name);
  });
  $('new-task').addEventListener('click', () => {
    closeStream();
    view.generation += 1;
    view.taskId = null;
    view.lastSeq = 0;
    view.seqs = [];
    view.turn = null;
    resetMessages();
    for (const item of $('task-list').children) item.classList.remove('open');
    $('transcript').replaceChildren();
    $('hitl').replaceChildren();
    $('task-title').textContent = 'New task';
    setStatus('');
    $('stream-status').textContent = '';
    $('message-input').focus();
  });
  $('send-form').addEventListener('submit', async (event) => {
    event.preventDefault();
    const input = $('message-input');
    if (await send(input.value, $('agent-input').value.trim())) input.value = '';
  });
  $('message-input').addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && (event.ctrlKey || event.metaKey)) $('send-form').requestSubmit();
  });
  $('memory-form').addEventListener('submit', (event) => {
    event.preventDefault();
    loadMemory();
  });
  const saved = sessionStorage.getItem(KEY_STORAGE);
  if (saved) signIn(saved, { remembered: true }).catch((error) => signOut(`${error.code || 'ERROR'}: ${error.message}`));
}

start();
