// Chart helpers over the vendored libraries: Apache ECharts (canvas) for scatter, parallel
// coordinates, bars and the arrays timeline; uPlot for the learning curves (many lines).
//
// Text rule: every string a tenant controls (param names, categorical choices, study names,
// metric names, user attrs, errors) is shown as text. ECharts parses a string that a tooltip
// formatter returns as HTML, so the views' formatters return tip(...) (an element of text
// nodes), and ecChart() wraps every tooltip formatter so that a string one returns is shown
// as text too; a string template formatter ("{b}: {c}") is refused. Canvas text (axis labels
// and names, legends, series labels) is not HTML, and no option here sets `rich` styles, so
// "{a|...}" in a name is drawn as it is. uPlot writes its labels with textContent.

import * as echarts from "./vendor/echarts-6.1.0/echarts.esm.min.js";
import uPlot from "./vendor/uplot-1.6.32/uPlot.esm.js";
import { h } from "./util.js";

export { echarts, uPlot };

export const PALETTE = ["#2563eb", "#16a34a", "#f59e0b", "#dc2626", "#8b5cf6", "#0891b2", "#db2777", "#65a30d"];

/** A titled chart panel; `name` is what tests and screenshots find it by (data-chart). */
export function panel(name, title, { height = 320, note = null } = {}) {
  const body = h("div.chart", { "data-chart": name, style: { height: `${height}px` }, role: "img", "aria-label": title });
  const noteEl = h("p.note", note ?? "");
  const root = h("section.panel", { "aria-label": title }, h("h3", title), noteEl, body);
  return { root, body, note: noteEl };
}

/**
 * A tooltip's content: one line per argument, each a string (or an array of strings and
 * nodes), as text nodes: ECharts shows an element as it is, where it would parse a string.
 */
export function tip(...lines) {
  return h("div.tip", ...lines.map((line) => h("div", line)));
}

/** A tooltip formatter whose strings are shown as text (see the text rule at the top). */
function asText(formatter) {
  if (formatter === undefined || formatter === null) return formatter;
  if (typeof formatter !== "function") throw new TypeError("tooltip formatters are functions here (a string template is HTML to ECharts)");
  if (formatter.asText) return formatter;
  const wrapped = (...args) => {
    const out = formatter(...args);
    if (out === null || out === undefined || out === "") return "";
    return out instanceof Node ? out : Array.isArray(out) ? tip(...out) : tip(String(out));
  };
  wrapped.asText = true;
  return wrapped;
}

function textTooltips(option) {
  const fix = (tooltip) => (tooltip && typeof tooltip === "object" && "formatter" in tooltip ? { ...tooltip, formatter: asText(tooltip.formatter) } : tooltip);
  const out = { ...option };
  if ("tooltip" in out) out.tooltip = Array.isArray(out.tooltip) ? out.tooltip.map(fix) : fix(out.tooltip);
  if (Array.isArray(out.series)) out.series = out.series.map((s) => (s && "tooltip" in s ? { ...s, tooltip: fix(s.tooltip) } : s));
  else if (out.series && "tooltip" in out.series) out.series = { ...out.series, tooltip: fix(out.series.tooltip) };
  return out;
}

// zrender, ECharts' renderer, caches the widths of the texts it draws in an LRU keyed by the
// text in a plain object. A line of text that is exactly "__proto__" reads Object.prototype as
// its cache entry and links it into the LRU's list, which gives every object of the page
// enumerable `prev` and `next` (uPlot then recursed without end copying its options). A param
// name, a categorical choice or a metric is the tenant's and can be that text: such a line is
// drawn with a zero-width space after it, which looks the same and is another key.
const PROTO_LINE = /(^|\n)__proto__(?=\n|$)/g;

function safeTexts(value) {
  if (typeof value === "string") return value.includes("__proto__") ? value.replace(PROTO_LINE, "$1__proto__\u200b") : value;
  // Copied only where something changed: the option of a 100,000-trial history stays as it is.
  if (Array.isArray(value)) {
    let out = null;
    for (let i = 0; i < value.length; i++) {
      const v = safeTexts(value[i]);
      if (v !== value[i]) (out ??= value.slice())[i] = v;
    }
    return out ?? value;
  }
  if (value === null || typeof value !== "object" || Object.getPrototypeOf(value) !== Object.prototype) return value;
  let changed = false;
  const entries = Object.entries(value).map(([k, v]) => {
    const safe = safeTexts(v);
    changed ||= safe !== v;
    return [k, safe];
  });
  return changed ? Object.fromEntries(entries) : value;
}

/** An ECharts instance on `el`, resized with it, whose tooltips show text; returns {chart, dispose}. */
export function ecChart(el) {
  const chart = echarts.init(el, null, { renderer: "canvas" });
  const setOption = chart.setOption.bind(chart);
  chart.setOption = (option, ...rest) => setOption(safeTexts(textTooltips(option)), ...rest);
  const ro = new ResizeObserver(() => chart.resize());
  ro.observe(el);
  return {
    chart,
    dispose() { ro.disconnect(); chart.dispose(); },
  };
}

/** A uPlot chart filling `el`, resized with it. */
export function upChart(el, opts, data) {
  const size = () => ({ width: Math.max(200, el.clientWidth), height: Math.max(120, el.clientHeight - 30) });
  const plot = new uPlot({ ...opts, ...size() }, data, el);
  const ro = new ResizeObserver(() => plot.setSize(size()));
  ro.observe(el);
  return {
    plot,
    dispose() { ro.disconnect(); plot.destroy(); },
  };
}

export const AXIS = { axisLine: { lineStyle: { color: "#94a3b8" } }, splitLine: { lineStyle: { color: "#e2e8f0" } } };
export const GRID = { left: 56, right: 24, top: 28, bottom: 40, containLabel: false };

export function isLog(distribution) {
  return Boolean(distribution?.attributes?.log);
}

export function isCategorical(distribution) {
  return distribution?.name === "CategoricalDistribution";
}

export function choices(distribution) {
  return distribution?.attributes?.choices ?? [];
}
