// The REST API as the page uses it: the tenant token as a bearer header on every request,
// JSON in and out, and server-sent events read with fetch (EventSource cannot send a header).

const TOKEN_KEY = "fusetune.token";

export class ApiError extends Error {
  constructor(status, detail) {
    super(typeof detail === "string" ? detail : JSON.stringify(detail));
    this.status = status;
    this.detail = detail;
  }
}

export const auth = {
  get token() { return sessionStorage.getItem(TOKEN_KEY); },
  set(token) { sessionStorage.setItem(TOKEN_KEY, token); },
  clear() { sessionStorage.removeItem(TOKEN_KEY); },
};

let onUnauthorized = () => {};
export function setUnauthorizedHandler(fn) { onUnauthorized = fn; }

function url(path, params) {
  const u = new URL(path.startsWith("/") ? path : `/api/v1/${path}`, location.origin);
  for (const [k, v] of Object.entries(params || {})) {
    if (v === undefined || v === null) continue;
    if (Array.isArray(v)) v.forEach((x) => u.searchParams.append(k, x));
    else u.searchParams.set(k, v);
  }
  return u;
}

export async function request(method, path, opts = {}) {
  return (await exchange(method, path, opts)).body;
}

/** A GET of one page of a listing: its rows, and the URL of the next page (the Link header). */
export async function getPage(path, params, opts = {}) {
  const { body, headers } = await exchange("GET", path, { ...opts, params });
  const link = headers.get("Link");
  const m = link && link.match(/<([^>]+)>\s*;\s*rel="?next"?/);
  return { items: body, next: m ? m[1] : null };
}

async function exchange(method, path, { params, body, token = auth.token, signal } = {}) {
  const headers = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(url(path, params), {
    method, headers, signal, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (response.status === 401 && token === auth.token) onUnauthorized();
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail ?? detail; } catch { /* not JSON */ }
    throw new ApiError(response.status, detail);
  }
  return { body: response.status === 204 ? null : await response.json(), headers: response.headers };
}

export const get = (path, params, opts) => request("GET", path, { ...opts, params });
export const post = (path, body, opts) => request("POST", path, { ...opts, body });

/** A download through the bearer header: fetches the body and saves it as `filename`. */
export async function download(path, filename) {
  const response = await fetch(url(path), { headers: { Authorization: `Bearer ${auth.token}` } });
  if (!response.ok) throw new ApiError(response.status, response.statusText);
  const blob = await response.blob();
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10_000);
}

// -- what the server offers: read once from its OpenAPI document ------------------------------

let routes = null;
/** The server's (method, path) pairs, from /openapi.json: the page offers what the server has. */
export async function serverRoutes() {
  if (routes) return routes;
  try {
    const doc = await (await fetch("/openapi.json")).json();
    routes = new Set();
    for (const [p, ops] of Object.entries(doc.paths || {})) {
      for (const m of Object.keys(ops)) routes.add(`${m.toUpperCase()} ${p}`);
    }
    routes.params = {};
    for (const [p, ops] of Object.entries(doc.paths || {})) {
      for (const [m, op] of Object.entries(ops)) {
        routes.params[`${m.toUpperCase()} ${p}`] = new Set((op.parameters || []).map((x) => x.name));
      }
    }
  } catch {
    routes = new Set();
    routes.params = {};
  }
  return routes;
}

export function hasRoute(method, path) {
  return Boolean(routes && routes.has(`${method} ${path}`));
}

export function routeTakes(method, path, param) {
  return Boolean(routes && routes.params[`${method} ${path}`]?.has(param));
}

// -- server-sent events over fetch --------------------------------------------------------------

/**
 * Follows an SSE stream with the bearer header, resuming with Last-Event-ID after the server
 * closes it or the network drops. onEvent({id, event, data}) gets each event (data parsed as
 * JSON when it is). Returns {close()}; onState("open" | "retrying" | "closed").
 */
export function follow(path, { params, onEvent, onState = () => {}, lastEventId = null }) {
  let closed = false;
  let controller = null;
  let retryMs = 1000;
  let last = lastEventId;

  async function run() {
    while (!closed) {
      controller = new AbortController();
      try {
        const headers = { Accept: "text/event-stream", Authorization: `Bearer ${auth.token}` };
        if (last !== null) headers["Last-Event-ID"] = String(last);
        const response = await fetch(url(path, params), { headers, signal: controller.signal, cache: "no-store" });
        if (response.status === 401) { onUnauthorized(); return; }
        if (response.status === 404 || response.status === 403) { onState("closed"); return; }
        if (!response.ok || !response.body) throw new Error(`stream answered ${response.status}`);
        onState("open");
        retryMs = 1000;
        const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value;
          let cut;
          while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
            const block = buffer.slice(0, cut);
            buffer = buffer.slice(buffer[cut] === "\r" ? cut + 4 : cut + 2);
            const message = parseBlock(block);
            if (message.retry) retryMs = message.retry;
            if (message.id !== null) last = message.id;
            if (message.data !== null) onEvent(message);
          }
        }
      } catch (err) {
        if (closed) return;
      }
      if (closed) return;
      onState("retrying");
      await new Promise((r) => setTimeout(r, retryMs));
    }
  }
  run();
  return {
    close() { closed = true; controller?.abort(); onState("closed"); },
    get lastEventId() { return last; },
  };
}

function parseBlock(block) {
  const out = { id: null, event: "message", data: null, retry: null };
  const data = [];
  for (const line of block.split(/\r?\n/)) {
    if (!line || line.startsWith(":")) continue;
    const i = line.indexOf(":");
    const field = i < 0 ? line : line.slice(0, i);
    let value = i < 0 ? "" : line.slice(i + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") data.push(value);
    else if (field === "id") out.id = value;
    else if (field === "event") out.event = value;
    else if (field === "retry" && /^\d+$/.test(value)) out.retry = Number(value);
  }
  if (data.length) {
    const text = data.join("\n");
    try { out.data = JSON.parse(text); } catch { out.data = text; }
  }
  return out;
}
