// The cluster: devices by type and node, what each trains and its utilisation; the tenants'
// device shares against their fair shares and weights.

import { h, clear, fmtValue } from "../util.js";
import { panel, ecChart, tip, AXIS } from "../charts.js";
import { get } from "../api.js";

const POLL_MS = 3000;

export function clusterView() {
  const summary = h("div.stats", { "data-testid": "cluster-summary" });
  const devices = h("div.table-wrap");
  const shares = panel("shares", "Tenants: device share now against fair share", { height: 240 });
  const tenants = h("div.table-wrap");
  const root = h("div", h("h1", "Cluster"), summary, h("h2", "Devices"), devices,
    h("div.grid2", { style: { marginTop: "12px" } }, shares.root, h("section.panel", h("h3", "Tenants"), tenants)));
  const chart = ecChart(shares.body);
  let timer = null, stopped = false;

  function render(c) {
    const busy = c.devices.filter((d) => d.busy).length;
    const stat = (label, value) => h("div.stat", h("b", value), h("span", label));
    clear(summary).append(
      stat("devices", c.devices.length),
      stat("busy now", busy),
      ...Object.entries(c.device_types).map(([t, n]) => stat(`type ${t}`, n)),
      ...Object.entries(c.nodes).map(([node, n]) => stat(`node ${node}`, n)),
    );
    const rows = c.devices.map((d) => h("tr", { "data-device": d.name },
      h("td", d.name), h("td", d.device_type), h("td", d.node),
      h("td", d.busy ? (d.array_id ? h("span", h("a", { href: `#/studies/${d.study_id}/arrays` }, d.study_name), ` · array ${d.array_id} · ${d.members} members${d.models_steps_per_s ? ` · ${fmtValue(d.models_steps_per_s, 3)} models·steps/s` : ""}`) : h("span.muted", "another tenant's array")) : h("span.muted", "idle")),
      h("td", h("span.bar", { role: "img", "aria-label": `${Math.round(d.utilisation * 100)}% busy` }, h("span", { style: { width: `${Math.round(d.utilisation * 100)}%` } })), ` ${Math.round(d.utilisation * 100)}%`),
    ));
    clear(devices).append(c.devices.length
      ? h("table.plain", { "data-testid": "devices" },
        h("thead", h("tr", ...["Device", "Type", "Node", "Trains now", "Utilisation (5 min)"].map((t) => h("th", { scope: "col" }, t)))),
        h("tbody", rows))
      : h("div.empty", h("h2", "No devices yet"), h("p", "Workers register when the service starts its scheduling loop on a Ray cluster; an API-only server has none.")));
    const all = [...c.tenants, ...(c.others ? [c.others] : [])];
    clear(tenants).append(h("table.plain", { "data-testid": "tenants" },
      h("thead", h("tr", ...["Tenant", "Weight", "Running", "Waiting", "Devices", "Share", "Fair share"].map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", all.map((t) => h("tr", h("td", t.name), h("td", fmtValue(t.weight, 3)), h("td", t.running_trials), h("td", t.waiting_trials),
        h("td", t.devices), h("td", `${Math.round(t.share * 100)}%`), h("td", `${Math.round(t.fair_share * 100)}%`))))));
    chart.chart.setOption({
      animation: false,
      grid: { left: 80, right: 20, top: 30, bottom: 30 },
      legend: { top: 0 },
      tooltip: {
        trigger: "axis",
        formatter: (ps) => tip(ps[0]?.name ?? "", ...ps.map((p) => `${p.seriesName}: ${Math.round(p.value * 100)}%`)),
      },
      xAxis: { type: "value", max: 1, axisLabel: { formatter: (v) => `${Math.round(v * 100)}%` }, ...AXIS },
      yAxis: { type: "category", data: all.map((t) => t.name), ...AXIS },
      series: [
        { name: "share now", type: "bar", data: all.map((t) => t.share), itemStyle: { color: "#2563eb" } },
        { name: "fair share", type: "bar", data: all.map((t) => t.fair_share), itemStyle: { color: "#94a3b8" } },
      ],
    });
  }

  async function tick() {
    if (stopped) return;
    try { render(await get("cluster")); } catch (err) { clear(summary).append(h("p.error", `Could not load the cluster: ${err.message}`)); }
    timer = setTimeout(tick, POLL_MS);
  }
  tick();
  return { root, dispose() { stopped = true; clearTimeout(timer); chart.dispose(); } };
}
