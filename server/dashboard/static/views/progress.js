// Study progress: optimization history with the best-so-far line, learning curves with the
// pruned trials marked, and the Pareto front of a multi-objective study.

import { h, clear, STATE_COLOURS, fmtValue, sample } from "../util.js";
import { panel, ecChart, upChart, tip, AXIS, GRID } from "../charts.js";

const MAX_CURVES = 120;

export function progressTab(ctx) {
  const { store } = ctx;
  const stats = h("div.stats", { "data-testid": "stats" });
  const history = panel("history", "Optimization history", { height: 320 });
  const curves = panel("curves", "Learning curves (intermediate values)", { height: 320 });
  const pareto = panel("pareto", "Pareto front", { height: 340 });
  const grid = h("div.grid2", history.root, curves.root);
  const root = h("div", stats, grid);
  const hist = ecChart(history.body);
  let curvePlot = null;
  let curveKey = "";
  let paretoChart = null;

  function renderStats() {
    const s = store.study, c = s.trial_counts || {};
    const stat = (label, value, id) => h("div.stat", h("b", { "data-testid": id }, value), h("span", label));
    clear(stats).append(
      stat("complete", c.COMPLETE ?? 0, "n-complete"),
      stat("running", c.RUNNING ?? 0, "n-running"),
      stat("waiting", c.WAITING ?? 0, "n-waiting"),
      stat("pruned", c.PRUNED ?? 0, "n-pruned"),
      stat("failed", c.FAIL ?? 0, "n-failed"),
      stat(s.best_trial ? `best ${s.metrics?.[0] ?? "value"} (#${s.best_trial.number})` : "best", s.best_trial ? fmtValue(s.best_trial.value) : s.best_trials?.length ? `${s.best_trials.length} Pareto` : "–", "best"),
    );
  }

  function renderHistory() {
    const s = store.study;
    const maximize = (s.directions?.[0] ?? s.direction) === "maximize";
    // One pass over the trials. Above 3,000 points the scatter gets a flat Float64Array
    // (x0, y0, x1, y1, ...), which ECharts' large mode draws without a per-point object.
    const list = store.trialList;
    let n = 0;
    for (const t of list) if (t.state === "COMPLETE" && t.value !== null) n++;
    const large = n > 3000;
    const flat = large ? new Float64Array(2 * n) : null;
    const points = large ? null : [];
    const best = [];
    const pruned = [];
    let b = null, k = 0;
    for (const t of list) {
      if (t.state === "PRUNED" && t.value !== null) { pruned.push([t.number, t.value]); continue; }
      if (t.state !== "COMPLETE" || t.value === null) continue;
      const v = t.values ? t.values[0] : t.value;
      if (large) { flat[k++] = t.number; flat[k++] = v; } else points.push([t.number, v]);
      if (b === null || (maximize ? v > b : v < b)) { b = v; best.push([t.number, b]); }
    }
    if (b !== null && list.length) best.push([list[list.length - 1].number, b]);
    history.note.textContent = n
      ? `${n.toLocaleString()} complete trials${pruned.length ? `, ${pruned.length} pruned (their last intermediate value)` : ""}; ${maximize ? "higher" : "lower"} is better`
      : "No trial has completed yet; the history draws as trials finish.";
    hist.chart.setOption({
      animation: false,
      grid: GRID,
      tooltip: { trigger: "item", formatter: (p) => (Array.isArray(p.value) ? tip(`#${p.value[0]}: ${fmtValue(p.value[1])}`) : "") },
      legend: { top: 0, right: 0, data: ["complete", "pruned", "best so far"] },
      xAxis: { type: "value", name: "trial", nameLocation: "middle", nameGap: 24, ...AXIS, min: 0 },
      yAxis: { type: "value", name: s.metrics?.[0] ?? "value", scale: true, ...AXIS },
      series: [
        { name: "complete", type: "scatter", data: large ? flat : points, dimensions: ["trial", "value"], symbolSize: large ? 2 : 6, large, largeThreshold: 3000, progressive: 0, itemStyle: { color: "#2563eb" } },
        { name: "pruned", type: "scatter", data: large ? sample(pruned, 20000) : pruned, symbol: "diamond", symbolSize: large ? 2 : 5, large, progressive: 0, itemStyle: { color: STATE_COLOURS.PRUNED, opacity: 0.6 } },
        { name: "best so far", type: "line", step: "end", data: best, showSymbol: false, lineStyle: { color: "#dc2626", width: 2 }, itemStyle: { color: "#dc2626" }, sampling: "lttb" },
      ],
    }, { replaceMerge: ["series"] });
  }

  function chooseCurves() {
    const s = store.study;
    const maximize = (s.directions?.[0] ?? s.direction) === "maximize";
    const withCurves = store.trialList.filter((t) => t.hasCurve);
    if (withCurves.length <= MAX_CURVES) return { shown: withCurves, total: withCurves.length };
    const key = (t) => (t.value === null ? -Infinity : maximize ? t.value : -t.value);
    const running = withCurves.filter((t) => t.state === "RUNNING").slice(-30);
    const pruned = withCurves.filter((t) => t.state === "PRUNED").slice(-30);
    // The best K complete ones in one pass (a small sorted buffer), not a sort of them all.
    const K = MAX_CURVES - running.length - pruned.length;
    const done = [];
    for (const t of withCurves) {
      if (t.state !== "COMPLETE") continue;
      const v = key(t);
      if (done.length === K && v <= key(done[K - 1])) continue;
      let i = done.length;
      while (i > 0 && key(done[i - 1]) < v) i--;
      done.splice(i, 0, t);
      if (done.length > K) done.pop();
    }
    const shown = [...new Map([...done, ...running, ...pruned].map((t) => [t.id, t])).values()].sort((a, b) => a.number - b.number);
    return { shown, total: withCurves.length };
  }

  function renderCurves() {
    // While the first download runs, the curves are drawn once (from the first page) and
    // then when every trial is in: choosing the best of them reads them all.
    if (!store.complete && curvePlot) return;
    const { shown, total } = chooseCurves();
    curves.note.textContent = total
      ? `${shown.length === total ? total : `${shown.length} of ${total}`} trials${shown.length < total ? " (the best, the running and the latest pruned)" : ""}; pruned trials dashed, × where they were pruned`
      : "No trial has reported an epoch yet.";
    const maxStep = Math.max(0, ...shown.map((t) => Math.max(...Object.keys(t.iv).map(Number))));
    const xs = Array.from({ length: maxStep + 1 }, (_, i) => i);
    const data = [xs, ...shown.map((t) => xs.map((x) => t.iv[x] ?? null))];
    const key = shown.map((t) => `${t.id}:${t.state}`).join(",");
    if (!shown.length) {
      curvePlot?.dispose();
      curvePlot = null;
      curveKey = "";
      return;
    }
    if (curvePlot && key === curveKey) { curvePlot.plot.setData(data); return; }
    curvePlot?.dispose();
    curveKey = key;
    const prunedAt = shown.map((t) => (t.state === "PRUNED" ? Math.max(...Object.keys(t.iv).map(Number)) : null));
    curvePlot = upChart(curves.body, {
      legend: { show: false },
      cursor: { points: { show: false } },
      scales: { x: { time: false } },
      axes: [{ label: "epoch", stroke: "#475569" }, { stroke: "#475569", label: store.study.metrics?.[0] ?? "value", size: 60 }],
      series: [
        { label: "epoch" },
        ...shown.map((t) => ({
          label: `#${t.number}`,
          stroke: t.state === "PRUNED" ? STATE_COLOURS.PRUNED : t.state === "RUNNING" ? STATE_COLOURS.RUNNING : t.state === "FAIL" ? STATE_COLOURS.FAIL : "rgba(22,163,74,0.75)",
          width: 1.25,
          dash: t.state === "PRUNED" ? [5, 4] : undefined,
          points: { show: false },
          spanGaps: true,
        })),
      ],
      hooks: {
        draw: [(u) => {
          const c = u.ctx;
          c.save();
          c.strokeStyle = "#b45309";
          c.lineWidth = 2 * devicePixelRatio;
          const r = 4 * devicePixelRatio;
          prunedAt.forEach((step, i) => {
            if (step === null || !u.series[i + 1].show) return;
            const y = u.data[i + 1][step];
            if (y === null || y === undefined) return;
            const cx = u.valToPos(step, "x", true), cy = u.valToPos(y, "y", true);
            c.beginPath();
            c.moveTo(cx - r, cy - r); c.lineTo(cx + r, cy + r);
            c.moveTo(cx + r, cy - r); c.lineTo(cx - r, cy + r);
            c.stroke();
          });
          c.restore();
        }],
      },
    }, data);
  }

  function renderPareto() {
    const s = store.study;
    const multi = (s.directions?.length ?? 1) > 1;
    if (!multi) return;
    if (!paretoChart) {
      root.append(pareto.root);
      paretoChart = ecChart(pareto.body);
    }
    const [m0, m1] = [s.metrics?.[0] ?? "objective 0", s.metrics?.[1] ?? "objective 1"];
    const front = new Set((s.best_trials || []).map((b) => b.number));
    const done = store.trialList.filter((t) => t.state === "COMPLETE" && t.values && t.values.length > 1);
    const onFront = done.filter((t) => front.has(t.number)).map((t) => [t.values[0], t.values[1], t.number]);
    const others = sample(done.filter((t) => !front.has(t.number)), 20000).map((t) => [t.values[0], t.values[1], t.number]);
    onFront.sort((a, b) => a[0] - b[0]);
    pareto.note.textContent = `${onFront.length} trial${onFront.length === 1 ? "" : "s"} on the front of ${done.length} complete (${m0}: ${s.directions[0]}, ${m1}: ${s.directions[1]})`;
    paretoChart.chart.setOption({
      animation: false,
      grid: GRID,
      tooltip: { trigger: "item", formatter: (p) => tip(`#${p.value[2]}: ${m0} ${fmtValue(p.value[0])}, ${m1} ${fmtValue(p.value[1])}`) },
      legend: { top: 0, right: 0 },
      xAxis: { type: "value", name: m0, nameLocation: "middle", nameGap: 24, scale: true, ...AXIS },
      yAxis: { type: "value", name: m1, scale: true, ...AXIS },
      series: [
        { name: "dominated", type: "scatter", data: others, symbolSize: 5, itemStyle: { color: "#94a3b8" }, large: others.length > 3000, progressive: 0 },
        { name: "Pareto front", type: "scatter", data: onFront, symbolSize: 8, itemStyle: { color: "#dc2626" } },
      ],
    }, { replaceMerge: ["series"] });
  }

  function update() {
    if (!store.study) return;
    renderStats();
    renderHistory();
    renderCurves();
    renderPareto();
  }

  return {
    root,
    update,
    dispose() { hist.dispose(); curvePlot?.dispose(); paretoChart?.dispose(); },
  };
}
