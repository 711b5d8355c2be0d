// The trials table: virtualised (only the rows in view are in the DOM, whatever the count),
// sortable by any column, filterable by state and by params; a row opens the trial's drawer.

import { h, clear, fmtValue, fmtParam, fmtDuration, elapsed, STATES, own } from "../util.js";

const ROW = 30;
const OVERSCAN = 8;

/**
 * trialsTable({store, onOpen, selection}) -> {root, update(), setSelection(ids|null), dispose()}.
 * `selection` (a Set of trial ids, or null) is the brush of the parallel coordinates.
 */
export function trialsTable({ store, onOpen, height = 420, name = "trials" }) {
  const state = {
    sort: { key: "number", dir: 1 },
    states: new Set(STATES),
    query: "",
    selection: null,
    rows: [],
  };
  const scroller = h("div.scroller", { style: { height: `${height}px` }, tabindex: "-1" });
  const head = h("div.head", { role: "row" });
  const spacer = h("div", { style: { position: "relative" } });
  const foot = h("div.foot", { "data-testid": `${name}-count`, "aria-live": "polite" });
  const chips = h("span");
  const queryError = h("span.error", { role: "status" });
  const query = h("input", {
    type: "search", placeholder: "params, e.g. lr<0.01 hidden=64 value>0.9",
    "aria-label": "Filter trials by params", "data-testid": `${name}-filter`,
    oninput: (e) => { state.query = e.target.value; refresh(); },
  });
  const stateBoxes = STATES.map((s) => h("label", h("input", {
    type: "checkbox", checked: true, value: s, "data-state": s,
    onchange: (e) => { e.target.checked ? state.states.add(s) : state.states.delete(s); refresh(); },
  }), s.toLowerCase()));
  const root = h("div", { "data-table": name },
    h("div.filters", h("fieldset", h("legend", "State"), ...stateBoxes), query, chips, queryError),
    h("div.vtable", { role: "table", "aria-label": "Trials", "aria-rowcount": 0 },
      h("div.scroller-wrap", scroller), foot));
  scroller.append(head, spacer);

  let columns = [];
  let columnsShape = null;
  let template = "";
  let rendered = new Map(); // row index -> element

  function buildColumns() {
    const study = store.study;
    const params = Object.keys(store.distributions).length ? Object.keys(store.distributions)
      : [...new Set(store.trialList.slice(0, 200).flatMap((t) => Object.keys(t.params)))];
    const objectives = (study?.metrics?.length ? study.metrics : ["value"]);
    columns = [
      { key: "number", label: "#", get: (t) => t.number, width: "60px" },
      { key: "state", label: "State", get: (t) => t.state, width: "108px", render: (t) => h(`span.badge.${t.state}`, t.state) },
      ...(objectives.length > 1
        ? objectives.map((m, i) => ({ key: `v${i}`, label: m, get: (t) => (t.values ? t.values[i] : i === 0 ? t.value : null), fmt: fmtValue, width: "100px" }))
        : [{ key: "value", label: objectives[0] === "value" ? "value" : objectives[0], get: (t) => t.value, fmt: fmtValue, width: "100px" }]),
      ...params.map((p) => ({ key: `p:${p}`, label: p, get: (t) => own(t.params, p), fmt: fmtParam, width: "minmax(90px, 1fr)" })),
      { key: "epochs", label: "epochs", get: (t) => Object.keys(t.iv).length, width: "70px" },
      { key: "array", label: "array", get: (t) => t.array_id, width: "70px" },
      { key: "duration", label: "duration", get: (t) => elapsed(t.started_at, t.completed_at), fmt: fmtDuration, width: "100px" },
    ];
    template = columns.map((c) => c.width).join(" ");
    clear(head).style.gridTemplateColumns = template;
    const min = 60 * columns.length;
    head.style.minWidth = `${min}px`;
    spacer.style.minWidth = `${min}px`;
    for (const c of columns) {
      const sorted = state.sort.key === c.key ? (state.sort.dir > 0 ? "ascending" : "descending") : "none";
      head.append(h("button", {
        type: "button", role: "columnheader", "aria-sort": sorted, "data-sort": c.key, title: `Sort by ${c.label}`,
        onclick: () => {
          state.sort = state.sort.key === c.key ? { key: c.key, dir: -state.sort.dir } : { key: c.key, dir: 1 };
          buildColumns();
          refresh();
        },
      }, c.label));
    }
  }

  function parseQuery(text) {
    const terms = [];
    for (const raw of text.split(/[\s,]+/).filter(Boolean)) {
      const m = raw.match(/^([^<>=!~]+)(<=|>=|!=|=|<|>|~)(.+)$/);
      if (!m) throw new Error(`not a filter: ${raw} (use name<value, name=value, ...)`);
      const [, key, op, value] = m;
      const num = Number(value);
      terms.push({ key, op, value, num: Number.isFinite(num) ? num : null });
    }
    return terms;
  }

  function valueOf(t, key) {
    if (key === "value") return t.value;
    if (key === "number" || key === "#") return t.number;
    if (key === "array") return t.array_id;
    if (key === "state") return t.state;
    return own(t.params, key);
  }

  function matches(t, terms) {
    for (const { key, op, value, num } of terms) {
      const v = valueOf(t, key);
      if (v === undefined || v === null) return false;
      const n = typeof v === "number" ? v : null;
      switch (op) {
        case "<": if (!(n !== null && num !== null && n < num)) return false; break;
        case ">": if (!(n !== null && num !== null && n > num)) return false; break;
        case "<=": if (!(n !== null && num !== null && n <= num)) return false; break;
        case ">=": if (!(n !== null && num !== null && n >= num)) return false; break;
        case "=": if (!(n !== null && num !== null ? n === num : String(v) === value)) return false; break;
        case "!=": if (n !== null && num !== null ? n === num : String(v) === value) return false; break;
        case "~": if (!String(v).toLowerCase().includes(value.toLowerCase())) return false; break;
      }
    }
    return true;
  }

  function refresh() {
    const shape = `${Object.keys(store.distributions).join(",")}|${store.study?.metrics?.join(",")}`;
    if (shape !== columnsShape) { columnsShape = shape; buildColumns(); }
    let terms = [];
    try { terms = parseQuery(state.query); queryError.textContent = ""; } catch (err) { queryError.textContent = err.message; }
    const col = columns.find((c) => c.key === state.sort.key) || columns[0];
    const sel = state.selection;
    const rows = store.trialList.filter((t) => state.states.has(t.state) && (!sel || sel.has(t.id)) && (!terms.length || matches(t, terms)));
    const dir = state.sort.dir;
    rows.sort((a, b) => {
      const x = col.get(a), y = col.get(b);
      if (x === y) return a.number - b.number;
      if (x === null || x === undefined) return 1;
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * dir;
    });
    state.rows = rows;
    spacer.style.height = `${rows.length * ROW}px`;
    root.querySelector(".vtable").setAttribute("aria-rowcount", String(rows.length));
    const total = store.trialList.length;
    foot.textContent = rows.length === total ? `${total} trials` : `${rows.length} of ${total} trials`;
    clear(chips);
    if (sel) chips.append(h("span.chip", { "data-testid": `${name}-brushed` }, `brushed: ${sel.size}`,
      h("button.link", { type: "button", "aria-label": "Clear the brush", onclick: () => ctl.onClearSelection?.() }, "clear")));
    for (const el of rendered.values()) el.remove();
    rendered = new Map();
    paint();
  }

  function rowElement(t, i) {
    const row = h("div.row", {
      role: "row", tabindex: "0", "data-trial-id": t.id, "data-number": t.number, "aria-rowindex": i + 1,
      style: { top: `${ROW * i}px`, gridTemplateColumns: template, minWidth: spacer.style.minWidth, width: "100%" },
      onclick: () => onOpen(t.id),
      onkeydown: (e) => {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); onOpen(t.id); }
        else if (e.key === "ArrowDown" || e.key === "ArrowUp") {
          e.preventDefault();
          const next = i + (e.key === "ArrowDown" ? 1 : -1);
          if (next < 0 || next >= state.rows.length) return;
          scroller.scrollTop = Math.max(0, Math.min(scroller.scrollTop, next * ROW), (next + 2) * ROW - scroller.clientHeight);
          paint();
          rendered.get(next)?.focus({ preventScroll: true });
        }
      },
    });
    for (const c of columns) {
      const v = c.get(t);
      row.append(h("div.cell", { role: "cell" }, c.render ? c.render(t) : c.fmt ? c.fmt(v) : v ?? "–"));
    }
    return row;
  }

  function paint() {
    const top = scroller.scrollTop, view = scroller.clientHeight || height;
    const first = Math.max(0, Math.floor(top / ROW) - OVERSCAN);
    const last = Math.min(state.rows.length, Math.ceil((top + view) / ROW) + OVERSCAN);
    for (const [i, el] of rendered) {
      if (i < first || i >= last) { el.remove(); rendered.delete(i); }
    }
    for (let i = first; i < last; i++) {
      if (rendered.has(i)) continue;
      const el = rowElement(state.rows[i], i);
      rendered.set(i, el);
      spacer.append(el);
    }
  }

  scroller.addEventListener("scroll", () => requestAnimationFrame(paint), { passive: true });

  const ctl = {
    root,
    update: refresh,
    setSelection(ids) { state.selection = ids; refresh(); },
    onClearSelection: null,
    get rows() { return state.rows; },
    dispose() {},
  };
  buildColumns();
  return ctl;
}
