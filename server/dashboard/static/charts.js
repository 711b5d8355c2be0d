// Chart helpers over the vendored libraries: Apache ECharts (canvas) for scatter, parallel
// coordinates, bars and the arrays timeline; uPlot for the learning curves (many lines).

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

/** An ECharts instance on `el`, resized with it; returns {chart, dispose}. */
export function ecChart(el) {
  const chart = echarts.init(el, null, { renderer: "canvas" });
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
