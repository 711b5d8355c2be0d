// Small DOM and formatting helpers shared by the views.
//
// The page builds its DOM with h() only: children that are not nodes become text nodes, and
// attributes are set one by one, so a string from the API (a study's name, a param name, a
// categorical choice, a user attr, an error) is always text, never markup. Nothing in the page
// assigns innerHTML or outerHTML, or calls insertAdjacentHTML or document.write.

const URL_ATTRS = new Set(["href", "src", "action", "formaction", "xlink:href"]);

/** h("div.card#x", {onclick, "aria-label": ...}, child, ...): an element with attributes and children. */
export function h(tag, attrs, ...children) {
  const [name, ...rest] = tag.split(/(?=[.#])/);
  const node = document.createElement(name || "div");
  for (const part of rest) {
    if (part[0] === ".") node.classList.add(part.slice(1));
    else if (part[0] === "#") node.id = part.slice(1);
  }
  if (attrs !== undefined && attrs !== null && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
    children.unshift(attrs);
    attrs = null;
  }
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith("on")) {
      // A handler is a function, never a string of script (the CSP would refuse that too).
      if (typeof v !== "function") throw new TypeError(`h(): ${k} must be a function`);
      node.addEventListener(k.slice(2), v);
      continue;
    }
    if (URL_ATTRS.has(k) && /^\s*(javascript|data|vbscript):/i.test(String(v))) throw new TypeError(`h(): refused ${k}=${String(v).slice(0, 40)}`);
    if (k === "class") node.className = v;
    else if (k === "style" && typeof v === "object") Object.assign(node.style, v);
    else if (k in node && typeof v !== "string") node[k] = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const c of children) {
    if (c === undefined || c === null || c === false) continue;
    if (Array.isArray(c)) append(node, c);
    else node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

/** A <dl> of user attrs: each key, and its value (a string as it is, anything else as JSON), as text. */
export function attrList(attrs) {
  return h("dl.attrs", ...Object.entries(attrs ?? {}).flatMap(([k, v]) => [h("dt", k), h("dd", typeof v === "string" ? v : JSON.stringify(v))]));
}

/**
 * A tenant-keyed object's own value, or undefined. Param names are the tenant's: one named
 * `constructor`, `toString` or `__proto__` must read the trial's param, never the member
 * every JavaScript object inherits (which a plain `obj[name]` returns where the param is absent).
 */
export function own(obj, key) {
  return obj !== null && obj !== undefined && Object.hasOwn(obj, key) ? obj[key] : undefined;
}

/** Sets `obj[key]` as an own property, `__proto__` included (an assignment would set the prototype). */
export function setOwn(obj, key, value) {
  Object.defineProperty(obj, key, { value, enumerable: true, writable: true, configurable: true });
}

export function clear(node) {
  while (node.firstChild) node.firstChild.remove();
  return node;
}

export const STATES = ["WAITING", "RUNNING", "COMPLETE", "PRUNED", "FAIL"];
export const STATE_COLOURS = {
  WAITING: "#9aa5b1",
  RUNNING: "#3b82f6",
  COMPLETE: "#16a34a",
  PRUNED: "#f59e0b",
  FAIL: "#dc2626",
  MOVED: "#8b5cf6",
};

export function fmtValue(v, digits = 4) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(digits - 1);
  return v.toFixed(digits);
}

/** A short axis label: 0.001 as 1e-3, 0.25 as 0.25, 12000 as 1.2e+4. */
export function fmtAxis(v) {
  if (typeof v !== "number") return String(v);
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a < 1e-2 || a >= 1e5) return v.toExponential(a.toExponential(1).includes(".0e") ? 0 : 1);
  return String(Number(v.toPrecision(3)));
}

export function fmtParam(v) {
  return typeof v === "number" ? fmtValue(v, 4) : String(v);
}

export function fmtDate(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return d.toLocaleString(undefined, { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  seconds = Math.max(0, seconds);
  if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
  const m = Math.floor(seconds / 60), s = Math.round(seconds % 60);
  if (m < 60) return `${m} min ${s} s`;
  const hr = Math.floor(m / 60);
  if (hr < 48) return `${hr} h ${m % 60} min`;
  return `${Math.floor(hr / 24)} d ${hr % 24} h`;
}

export function elapsed(fromIso, toIso) {
  if (!fromIso) return null;
  const to = toIso ? Date.parse(toIso) : Date.now();
  return (to - Date.parse(fromIso)) / 1000;
}

/** Calls fn at most once per animation frame, with the latest arguments. */
export function perFrame(fn) {
  let pending = false, args = [];
  return (...a) => {
    args = a;
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; fn(...args); });
  };
}

export function debounce(fn, ms) {
  let timer = null;
  return (...a) => { clearTimeout(timer); timer = setTimeout(() => fn(...a), ms); };
}

/** A deterministic sample of at most n items (always keeping those keep() marks). */
export function sample(items, n, keep = () => false) {
  if (items.length <= n) return items;
  const out = [];
  const stride = items.length / n;
  let next = 0;
  for (let i = 0; i < items.length; i++) {
    if (i >= next) { out.push(items[i]); next += stride; }
    else if (keep(items[i])) out.push(items[i]);
  }
  return out;
}

export function announce(text) {
  const live = document.getElementById("live-region");
  if (live) live.textContent = text;
}
