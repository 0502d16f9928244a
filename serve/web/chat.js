// The chat page's behaviour: the conversation (kept in this tab's sessionStorage, so a reload
// keeps it), streaming answers from /v1/chat/completions over fetch, Stop (aborting the fetch: the
// server cancels the request and frees its slot), the API key (asked for when the server answers
// 401, kept in sessionStorage) and the server's errors shown as sentences the user can act on.
// Everything the model or the user wrote is shown as text (markdown.js), never as markup.

import { renderMarkdown } from "./markdown.js";

const KEY_ITEM = "jinfer.apiKey";
const CONVERSATION_ITEM = "jinfer.conversation";
const SETTINGS_ITEM = "jinfer.settings";
const SETTING_FIELDS = ["system", "temperature", "top-p", "max-tokens", "seed", "extra"];

const $ = (id) => document.getElementById(id);
let conversation = readJSON(sessionStorage, CONVERSATION_ITEM, []);
let running = null; // the AbortController of the answer being streamed

class APIError extends Error {
  constructor(status, message, code = null, retryAfter = null) {
    super(message);
    this.status = status;
    this.code = code;
    this.retryAfter = retryAfter;
  }
}

function readJSON(storage, item, fallback) {
  try {
    return JSON.parse(storage.getItem(item)) ?? fallback;
  } catch {
    return fallback;
  }
}

// ------------------------------------------------------------------------------ the server
async function request(path, options = {}) {
  const headers = { ...options.headers };
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) headers.Authorization = `Bearer ${key}`;
  const response = await fetch(path, { ...options, headers });
  if (response.ok) return response;
  let message = `${response.status} ${response.statusText}`;
  let code = null;
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
    code = body.error?.code ?? null;
  } catch {
    // not JSON: the status line says enough
  }
  throw new APIError(response.status, message, code, response.headers.get("Retry-After"));
}

// `request`, asking for an API key (and trying again) for as long as the server answers 401.
async function withKey(path, options) {
  for (let refused = false; ; refused = true) {
    try {
      return await request(path, options);
    } catch (error) {
      if (!(error instanceof APIError) || error.status !== 401) throw error;
      await askKey(refused && sessionStorage.getItem(KEY_ITEM) !== null);
    }
  }
}

function askKey(refused) {
  const dialog = $("key-dialog");
  $("key-message").textContent = refused
    ? "The server refused that API key. Enter another:"
    : "This server needs an API key.";
  $("key-input").value = "";
  return new Promise((resolve, reject) => {
    const done = () => {
      dialog.removeEventListener("close", done);
      const key = $("key-input").value.trim();
      if (dialog.returnValue === "cancel" || key === "") {
        reject(new APIError(401, "This server needs an API key.", "invalid_api_key"));
        return;
      }
      sessionStorage.setItem(KEY_ITEM, key);
      resolve();
    };
    dialog.returnValue = "";
    dialog.addEventListener("close", done);
    dialog.addEventListener("cancel", () => (dialog.returnValue = "cancel"), { once: true });
    dialog.showModal();
  });
}

// The data of each Server-Sent Event of a response body.
async function* events(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

// What went wrong, in sentences that say what to do about it.
function describe(error) {
  const said = (error.message || String(error)).replace(/[.\s]*$/, ".");
  if (!(error instanceof APIError)) return `Cannot reach the server: ${said}`;
  const wait = error.retryAfter ? ` Try again in ${error.retryAfter} s.` : "";
  if (error.status === 429) return `The server is busy: ${said}${wait}`;
  if (error.code === "not_ready") return `The server is warming up.${wait || " Try again in a few seconds."}`;
  if (error.code === "context_length_exceeded") {
    return `Too long for the model's context: ${said} Start a new chat or lower max tokens.`;
  }
  return `Error ${error.status}: ${said}`;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

// ------------------------------------------------------------------------------ the page
function saveSettings() {
  const values = Object.fromEntries(SETTING_FIELDS.map((id) => [id, $(id).value]));
  localStorage.setItem(SETTINGS_ITEM, JSON.stringify(values));
}

// The request's sampling fields from the settings panel; an error for a field that won't do.
function requestFields() {
  const fields = {};
  const number = (id, name, parse) => {
    const text = $(id).value.trim();
    if (text === "") return;
    const value = parse(text);
    if (!Number.isFinite(value) || !$(id).checkValidity()) throw new Error(`${name}: ${$(id).validationMessage || "not a number"}`);
    fields[name] = value;
  };
  number("temperature", "temperature", parseFloat);
  number("top-p", "top_p", parseFloat);
  number("max-tokens", "max_tokens", Number);
  number("seed", "seed", Number);
  const extra = $("extra").value.trim();
  if (extra !== "") {
    let parsed;
    try {
      parsed = JSON.parse(extra);
    } catch (error) {
      throw new Error(`More request fields: not JSON (${error.message})`);
    }
    if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
      throw new Error("More request fields: must be a JSON object");
    }
    Object.assign(fields, parsed);
  }
  return fields;
}

function addMessage(role, text) {
  const node = document.createElement("div");
  node.className = `message ${role}`;
  const content = document.createElement("div");
  content.className = "content";
  const stats = document.createElement("div");
  stats.className = "stats";
  node.append(content, stats);
  if (role === "user") content.textContent = text;
  else renderMarkdown(text, content);
  $("conversation").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

function statsLine(s) {
  const parts = [];
  if (s.ttft_ms != null) parts.push(`first token ${Math.round(s.ttft_ms)} ms`);
  if (s.tokens_per_s != null) parts.push(`${s.tokens_per_s.toFixed(1)} tokens/s`);
  if (s.usage) {
    const cached = s.usage.prompt_tokens_details?.cached_tokens;
    parts.push(
      `${s.usage.prompt_tokens} prompt${cached ? ` (${cached} cached)` : ""} + ` +
        `${s.usage.completion_tokens} completion tokens`,
    );
  }
  if (s.finish_reason) parts.push(s.finish_reason === "stopped" ? "stopped" : `finish: ${s.finish_reason}`);
  if (s.seed != null) parts.push(`seed ${s.seed}`);
  return parts.join(" · ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.dataset.busy = busy ? "true" : "false";
}

function saveConversation() {
  sessionStorage.setItem(CONVERSATION_ITEM, JSON.stringify(conversation));
}

function showConversation() {
  $("conversation").replaceChildren();
  for (const message of conversation) {
    const node = addMessage(message.role, message.content);
    if (message.stats) {
      node.querySelector(".stats").textContent = statsLine(message.stats);
      node.dataset.state = "done";
    }
  }
}

async function send(text) {
  let fields;
  try {
    fields = requestFields();
  } catch (error) {
    showError(error.message);
    return;
  }
  showError("");
  saveSettings();
  const system = $("system").value.trim();
  const thread = conversation; // "New chat" while this streams starts another
  thread.push({ role: "user", content: text });
  const history = thread.map(({ role, content }) => ({ role, content }));
  const body = {
    ...($("model").value ? { model: $("model").value } : {}),
    messages: system ? [{ role: "system", content: system }, ...history] : history,
    ...fields,
    stream: true,
    stream_options: { include_usage: true },
  };
  const userNode = addMessage("user", text);
  const answer = addMessage("assistant", "");
  const content = answer.querySelector(".content");
  answer.dataset.state = "streaming";
  running = new AbortController();
  setBusy(true);
  const started = performance.now();
  let first = null;
  let last = null;
  let raw = "";
  const stats = {};
  const draw = () => {
    const view = $("conversation");
    const following = view.scrollHeight - view.scrollTop - view.clientHeight < 48; // else the reader scrolled up
    renderMarkdown(raw, content);
    if (following) view.scrollTop = view.scrollHeight;
  };
  try {
    const options = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
    const response = await withKey("/v1/chat/completions", { ...options, signal: running.signal });
    for await (const data of events(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new APIError(500, chunk.error.message, chunk.error.code);
      const choice = chunk.choices?.[0];
      const delta = choice?.delta?.content;
      if (delta) {
        last = performance.now();
        first ??= last;
        raw += delta;
        draw();
      }
      if (choice?.finish_reason) stats.finish_reason = choice.finish_reason;
      if (chunk.usage) {
        stats.usage = chunk.usage;
        stats.seed = chunk.jinfer?.seed;
      }
    }
    answer.dataset.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      stats.finish_reason = "stopped";
      answer.dataset.state = "stopped";
    } else if (raw === "") {
      // Nothing came: the question goes back into the box, as if it had not been sent.
      thread.pop();
      userNode.remove();
      answer.remove();
      $("prompt").value = text;
      showError(describe(error));
      return;
    } else {
      answer.dataset.state = "error";
      showError(describe(error));
    }
  } finally {
    running = null;
    setBusy(false);
  }
  if (thread !== conversation) return;
  if (first !== null) stats.ttft_ms = first - started;
  const decoded = stats.usage?.completion_tokens;
  if (decoded > 1 && last > first) stats.tokens_per_s = (decoded - 1) / ((last - first) / 1000);
  draw();
  answer.querySelector(".stats").textContent = statsLine(stats);
  thread.push({ role: "assistant", content: raw, stats });
  saveConversation();
}

async function loadModels() {
  try {
    const response = await withKey("/v1/models");
    const { data } = await response.json();
    $("model").replaceChildren(
      ...data.map((model) => {
        const option = document.createElement("option");
        option.value = option.textContent = model.id;
        return option;
      }),
    );
  } catch (error) {
    showError(describe(error));
  }
}

function start() {
  const saved = readJSON(localStorage, SETTINGS_ITEM, {});
  for (const id of SETTING_FIELDS) if (typeof saved[id] === "string") $(id).value = saved[id];
  if (window.matchMedia("(max-width: 700px)").matches) $("settings").open = false;
  for (const id of SETTING_FIELDS) $(id).addEventListener("change", saveSettings);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (running || text.trim() === "") return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running?.abort());
  $("new-chat").addEventListener("click", () => {
    running?.abort();
    conversation = [];
    saveConversation();
    showConversation();
    showError("");
    $("prompt").focus();
  });
  setBusy(false);
  showConversation();
  loadModels();
}

start();
