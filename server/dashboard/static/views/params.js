// Study parameters: parameter importances (Optuna's evaluators, computed by the server and
// cached there), parallel coordinates whose brush filters the trials table below them, and a
// slice plot per parameter.

import { h, clear, fmtValue, fmtParam, fmtAxis, sample, debounce, own } from "../util.js";
import { panel, ecChart, tip, AXIS, isLog, isCategorical, choices } from "../charts.js";
import { get } from "../api.js";
import { trialsTable } from "./table.js";

const MAX_LINES = 4000; // lines drawn; brushing filters every trial
const MAX_SLICE_POINTS = 8000;

export function paramsTab(ctx) {
  const { store } = ctx;
  const imp = panel("importances", "Parameter importances", { height: 220 });
  const evaluator = h("select", { "aria-label": "Importance evaluator", onchange: () => loadImportances(true) },
    h("option", { value: "fanova" }, "fANOVA"), h("option", { value: "mdi" }, "mean decrease impurity"), h("option", { value: "ped_anova" }, "PED-ANOVA"));
  imp.root.querySelector("h3").append(" ", evaluator);
  const par = panel("parallel", "Parallel coordinates", { height: 360, note: "Drag along an axis to brush; the table below shows the brushed trials." });
  const slices = h("div.grid3", { "data-testid": "slices" });
  const table = trialsTable({ store, onOpen: ctx.openTrial, height: 300, name: "param-trials" });
  table.onClearSelection = () => clearBrush();
  slices.append(imp.root);
  const root = h("div", par.root, h("h3", { style: { margin: "12px 0 6px" } }, "Trials in the brush"), table.root,
    h("h3", { style: { margin: "12px 0 6px" } }, "Importances and slice plots"), slices);
  const parallel = ecChart(par.body);
  const importances = ecChart(imp.body);
  const sliceCharts = new Map();
  let intervals = {}; // axis dim -> [[lo, hi], ...]
  let axes = [];
  let axesKey = null;
  let impVersion = null;

  function paramNames() {
    const names = Object.keys(store.distributions);
    return names.length ? names : [...new Set(store.trialList.slice(0, 200).flatMap((t) => Object.keys(t.params)))];
  }

  function axisOf(name, dim) {
    const d = own(store.distributions, name);
    if (isCategorical(d)) return { dim, name, type: "category", data: choices(d).map(String), categorical: true };
    // Optuna's log distributions have low > 0, so a log axis holds every value.
    return { dim, name, type: isLog(d) ? "log" : "value", min: d?.attributes?.low, max: d?.attributes?.high, scale: true };
  }

  function objectiveValue(t) { return t.values ? t.values[0] : t.value; }

  function renderParallel() {
    const names = paramNames();
    const objective = store.study.metrics?.[0] ?? "value";
    axes = [...names.map((n, i) => axisOf(n, i)), { dim: names.length, name: objective, type: "value", scale: true, objective: true }];
    const done = store.trialList.filter((t) => t.state === "COMPLETE" && objectiveValue(t) !== null);
    const row = (t) => [...names.map((n, i) => (axes[i].categorical ? String(own(t.params, n)) : own(t.params, n))), objectiveValue(t), t.id];
    const lines = sample(done, MAX_LINES).map(row);
    par.note.textContent = done.length
      ? `${done.length} complete trials${lines.length < done.length ? ` (${lines.length} drawn; the brush filters all of them)` : ""}. Drag along an axis to brush; click an axis outside its brush to clear it.`
      : "The parallel coordinates draw once trials complete.";
    const values = done.map(objectiveValue);
    let lo = Infinity, hi = -Infinity;
    for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
    const visualMap = values.length ? {
      show: false, dimension: names.length, min: lo, max: hi === lo ? lo + 1e-9 : hi,
      inRange: { color: ["#1e3a8a", "#22c55e", "#facc15"] },
    } : undefined;
    const series = [{
      type: "parallel", data: lines, smooth: false, progressive: 1000,
      lineStyle: { width: 1, opacity: lines.length > 1000 ? 0.25 : 0.6 },
      inactiveOpacity: 0.03, activeOpacity: 1,
    }];
    const key = JSON.stringify(axes);
    if (key === axesKey) {
      // Same axes: new data only, so the brush drawn on them stays.
      parallel.chart.setOption({ visualMap, series });
    } else {
      axesKey = key;
      intervals = {};
      parallel.chart.setOption({
        animation: false,
        parallel: { left: 50, right: 70, top: 30, bottom: 30, parallelAxisDefault: { nameLocation: "start", nameGap: 14, areaSelectStyle: { width: 24, opacity: 0.25 } } },
        parallelAxis: axes.map((a) => ({
          id: `axis-${a.dim}`, dim: a.dim, name: a.name, type: a.type, data: a.data, scale: a.scale,
          axisLabel: { formatter: fmtAxis }, ...AXIS,
        })),
        visualMap,
        series,
      }, { replaceMerge: ["series", "parallelAxis", "visualMap"] });
    }
    applyBrush();
  }

  parallel.chart.on("axisareaselected", (event) => {
    const id = event.parallelAxisId;
    const dim = Number(String(id).replace("axis-", ""));
    if (!Number.isFinite(dim)) return;
    if (event.intervals && event.intervals.length) intervals[dim] = event.intervals;
    else delete intervals[dim];
    applyBrush();
  });

  function inBrush(t) {
    for (const [dimText, list] of Object.entries(intervals)) {
      const a = axes[Number(dimText)];
      if (!a) continue;
      let v = a.objective ? objectiveValue(t) : own(t.params, a.name);
      if (v === undefined || v === null) return false;
      if (a.categorical) v = a.data.indexOf(String(v));
      if (!list.some(([lo, hi]) => v >= Math.min(lo, hi) && v <= Math.max(lo, hi))) return false;
    }
    return true;
  }

  function applyBrush() {
    if (!Object.keys(intervals).length) { table.setSelection(null); return; }
    const ids = new Set(store.trialList.filter((t) => t.state === "COMPLETE" && inBrush(t)).map((t) => t.id));
    table.setSelection(ids);
    ctx.setSelection?.(ids);
  }

  function clearBrush() {
    intervals = {};
    parallel.chart.dispatchAction({ type: "axisAreaSelect", parallelAxisId: axes.map((a) => `axis-${a.dim}`), intervals: [] });
    for (const a of axes) parallel.chart.dispatchAction({ type: "axisAreaSelect", parallelAxisId: `axis-${a.dim}`, intervals: [] });
    table.setSelection(null);
    ctx.setSelection?.(null);
  }

  async function loadImportances(force = false) {
    const complete = store.study.trial_counts?.COMPLETE ?? 0;
    if (!force && impVersion === complete) return;
    impVersion = complete;
    if (complete < 2) {
      imp.note.textContent = "Importances need at least two complete trials.";
      importances.chart.clear();
      return;
    }
    imp.note.textContent = "Computing on the server…";
    try {
      const out = await get(`studies/${store.id}/importances`, { evaluator: evaluator.value });
      const entries = Object.entries(out.importances).sort((a, b) => a[1] - b[1]);
      imp.note.textContent = entries.length
        ? `${out.evaluator} over ${out.n_used}${out.n_used < out.n_complete ? ` of ${out.n_complete}` : ""} complete trials${out.cached ? " (cached)" : ""}`
        : "No parameter varies over the complete trials yet.";
      importances.chart.setOption({
        animation: false,
        grid: { left: 110, right: 40, top: 10, bottom: 24 },
        tooltip: { trigger: "item", formatter: (p) => tip(`${p.name}: ${fmtValue(p.value, 3)}`) }, // text: a param name is the tenant's
        xAxis: { type: "value", max: 1, ...AXIS },
        yAxis: { type: "category", data: entries.map((e) => e[0]), ...AXIS },
        series: [{ type: "bar", data: entries.map((e) => e[1]), itemStyle: { color: "#2563eb" }, label: { show: true, position: "right", formatter: (p) => fmtValue(p.value, 2) } }],
      }, { replaceMerge: ["series"] });
    } catch (err) {
      imp.note.textContent = `Importances: ${err.message}`;
    }
  }
  const loadImportancesSoon = debounce(() => loadImportances(), 1500);

  function renderSlices() {
    const names = paramNames();
    const objective = store.study.metrics?.[0] ?? "value";
    const done = store.trialList.filter((t) => t.state === "COMPLETE" && objectiveValue(t) !== null);
    const shown = sample(done, MAX_SLICE_POINTS);
    for (const name of names) {
      let entry = sliceCharts.get(name);
      if (!entry) {
        const p = panel(`slice-${name}`, `${name}`, { height: 220 });
        p.body.dataset.chartKind = "slice";
        slices.append(p.root);
        entry = { panel: p, ec: ecChart(p.body) };
        sliceCharts.set(name, entry);
      }
      const a = axisOf(name, 0);
      entry.panel.note.textContent = done.length ? `${objective} against ${name}${shown.length < done.length ? ` (${shown.length} of ${done.length})` : ""}` : "No complete trial yet.";
      entry.ec.chart.setOption({
        animation: false,
        grid: { left: 50, right: 12, top: 10, bottom: 30 },
        tooltip: { trigger: "item", formatter: (p) => tip(`#${p.value[2]}: ${name}=${fmtParam(p.value[0])}, ${fmtValue(p.value[1])}`) },
        xAxis: a.categorical ? { type: "category", data: a.data, ...AXIS } : { type: a.type, scale: true, axisLabel: { formatter: fmtAxis }, ...AXIS },
        yAxis: { type: "value", scale: true, ...AXIS },
        series: [{
          type: "scatter", symbolSize: shown.length > 2000 ? 3 : 6, large: shown.length > 3000, progressive: 0,
          data: shown.map((t) => [a.categorical ? String(own(t.params, name)) : own(t.params, name), objectiveValue(t), t.number]),
          itemStyle: { color: "#2563eb", opacity: 0.7 },
        }],
      }, { replaceMerge: ["series"] });
    }
  }

  function update() {
    if (!store.study) return;
    renderParallel();
    renderSlices();
    table.update();
    loadImportancesSoon();
  }
  loadImportances();

  return {
    root,
    update,
    brush: () => intervals,
    dispose() {
      parallel.dispose();
      importances.dispose();
      for (const e of sliceCharts.values()) e.ec.dispose();
    },
  };
}
