// The arrays view: a timeline per device of the study's fused arrays, each member's span inside
// its array (joined at the start, or later by backfill; left completed, pruned, failed, or
// moved: preempted or resumed elsewhere), and each array's measured models·steps/s against
// one member trained unfused on the same device type.

import { h, clear, STATE_COLOURS, fmtValue, fmtDate, fmtDuration, debounce } from "../util.js";
import { panel, ecChart, echarts, tip, AXIS } from "../charts.js";
import { get } from "../api.js";

export function arraysTab(ctx) {
  const { store } = ctx;
  const tl = panel("timeline", "Arrays per device", { height: 320 });
  const legend = h("div.legend",
    ...["RUNNING", "COMPLETE", "PRUNED", "FAIL", "MOVED"].map((s) => h("span", h("i", { style: { background: STATE_COLOURS[s] } }), s.toLowerCase())),
    h("span", h("i", { style: { border: "1px dashed #2563eb", background: "none" } }), "joined by backfill"));
  const list = h("div.arrays-list", { "data-testid": "arrays" });
  const root = h("div", tl.root, legend, list);
  const chart = ecChart(tl.body);
  let data = null;
  let highlight = null;

  function render() {
    if (!data) return;
    const devices = data.devices.length ? data.devices : ["(unassigned)"];
    const lane = (w) => Math.max(0, devices.indexOf(w ?? "(unassigned)"));
    const now = Date.parse(data.now);
    const byId = new Map(data.arrays.map((a) => [a.id, a]));
    tl.note.textContent = data.arrays.length
      ? `${data.arrays.length} arrays of ${data.arrays.reduce((n, a) => n + a.members.length, 0)} members on ${data.devices.length} devices; a bar is an array, a line inside it a member`
      : "No array has started yet.";
    tl.body.style.height = `${Math.max(200, 80 + devices.length * 70)}px`;
    chart.chart.resize();
    const items = data.arrays.map((a) => ({
      value: [lane(a.worker), Date.parse(a.created_at), a.completed_at ? Date.parse(a.completed_at) : now, a.id],
    }));
    chart.chart.setOption({
      animation: false,
      grid: { left: 110, right: 20, top: 10, bottom: 40 },
      tooltip: {
        trigger: "item",
        formatter: (p) => {
          const a = byId.get(p.value[3]);
          if (!a) return "";
          const rate = a.models_steps_per_s ? `${fmtValue(a.models_steps_per_s, 3)} models·steps/s` : "speed not measured yet";
          const vs = a.unfused_models_steps_per_s ? ` vs ${fmtValue(a.unfused_models_steps_per_s, 3)} unfused (${fmtValue(a.speedup ?? 0, 2)}×)` : "";
          return tip(`array ${a.id} on ${a.worker ?? "?"}: ${a.members.length} members, ${a.state}`, `${rate}${vs}`);
        },
      },
      xAxis: { type: "time", ...AXIS },
      yAxis: { type: "category", data: devices, inverse: true, ...AXIS },
      dataZoom: [{ type: "inside", xAxisIndex: 0, filterMode: "weakFilter" }],
      series: [{
        type: "custom",
        encode: { x: [1, 2], y: 0 },
        data: items,
        renderItem: (params, api) => {
          const a = byId.get(api.value(3));
          const start = api.coord([api.value(1), api.value(0)]);
          const end = api.coord([api.value(2), api.value(0)]);
          const bandH = api.size([0, 1])[1] * 0.8;
          const x = start[0], y = start[1] - bandH / 2, w = Math.max(2, end[0] - start[0]);
          const rect = echarts.graphic.clipRectByRect({ x, y, width: w, height: bandH }, {
            x: params.coordSys.x, y: params.coordSys.y, width: params.coordSys.width, height: params.coordSys.height,
          });
          if (!rect) return null;
          const children = [{
            type: "rect", shape: rect,
            style: { fill: a.id === highlight ? "#fde68a" : a.state === "FAIL" ? "#fee2e2" : "#e0e7ff", stroke: "#6366f1", lineWidth: 1 },
          }];
          const n = Math.max(1, a.members.length);
          const lineH = Math.max(1, (bandH - 4) / n);
          a.members.forEach((m, i) => {
            const t0 = m.joined_at ? Date.parse(m.joined_at) : api.value(1);
            const t1 = m.left_at ? Date.parse(m.left_at) : api.value(2);
            const p0 = api.coord([t0, api.value(0)])[0], p1 = api.coord([t1, api.value(0)])[0];
            const seg = echarts.graphic.clipRectByRect(
              { x: p0, y: y + 2 + i * lineH, width: Math.max(1, p1 - p0), height: Math.max(1, lineH - 1) },
              rect,
            );
            if (seg) children.push({ type: "rect", shape: seg, style: { fill: STATE_COLOURS[m.end] ?? "#64748b", opacity: m.backfill ? 0.55 : 0.9 } });
          });
          return { type: "group", children };
        },
      }],
    }, { replaceMerge: ["series"] });
    renderList();
  }

  function renderList() {
    clear(list);
    for (const a of [...data.arrays].reverse()) {
      const rate = a.models_steps_per_s
        ? `${fmtValue(a.models_steps_per_s, 3)} models·steps/s` + (a.unfused_models_steps_per_s ? ` against ${fmtValue(a.unfused_models_steps_per_s, 3)} unfused: ${fmtValue(a.speedup ?? 0, 2)}×` : "")
        : "speed not measured yet";
      const duration = fmtDuration(((a.completed_at ? Date.parse(a.completed_at) : Date.parse(data.now)) - Date.parse(a.created_at)) / 1000);
      list.append(h("div.array-card", { "data-array-id": a.id, id: `array-${a.id}`, tabindex: "-1", style: a.id === highlight ? { outline: "2px solid #f59e0b" } : {} },
        h("h4", `array ${a.id} `, h(`span.badge.${a.state}`, a.state), ` on ${a.worker ?? "?"} (${a.device_type ?? "?"}${a.node ? `, ${a.node}` : ""})`),
        h("div.counts", `${a.members.length} members · ${a.epochs_done} epochs · ${duration} · started ${fmtDate(a.created_at)} · ${rate}`),
        a.error ? h("p.error", a.error) : null,
        h("div.members", ...a.members.map((m) => h(`button.member${m.backfill ? ".backfill" : ""}`, {
          type: "button", "data-trial-number": m.number,
          title: `#${m.number}: ${m.end.toLowerCase()}${m.backfill ? ", joined by backfill" : ""}${m.left_at ? `, left ${fmtDate(m.left_at)}` : ""}`,
          style: { borderLeft: `4px solid ${STATE_COLOURS[m.end] ?? "#64748b"}` },
          onclick: () => ctx.openTrial(m.trial_id),
        }, `#${m.number}`))),
      ));
    }
    if (!data.arrays.length) list.append(h("p.muted", "The study's trials have not been placed in an array yet."));
  }

  async function load() {
    try {
      data = await get(`studies/${store.id}/timeline`);
      render();
    } catch (err) {
      tl.note.textContent = `Could not load the arrays: ${err.message}`;
    }
  }
  const loadSoon = debounce(load, 300);
  load();

  return {
    root,
    update: () => loadSoon(),
    focusArray(id) {
      highlight = id;
      render();
      document.getElementById(`array-${id}`)?.scrollIntoView({ block: "center" });
    },
    dispose() { chart.dispose(); },
  };
}
