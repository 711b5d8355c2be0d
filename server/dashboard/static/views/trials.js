// The trials tab: the whole table, and the per-trial drawer (params, curve, the array it
// trained in, its error if it failed, and a download of its weights).

import { h, clear, attrList, fmtValue, fmtParam, fmtDate, fmtDuration, elapsed } from "../util.js";
import { upChart } from "../charts.js";
import { get, download, hasRoute } from "../api.js";
import { trialsTable } from "./table.js";

export function trialsTab(ctx) {
  const table = trialsTable({ store: ctx.store, onOpen: ctx.openTrial, height: 560, name: "trials" });
  table.onClearSelection = () => ctx.setSelection(null);
  const root = h("div", table.root);
  return {
    root,
    table,
    update: () => table.update(),
    setSelection: (ids) => table.setSelection(ids),
    dispose() {},
  };
}

/** The drawer of one trial; returns {root, close()}. */
export function trialDrawer(trialId, { onClose, onArray }) {
  const body = h("div", h("p.muted", "Loading…"));
  const closeButton = h("button.close", { type: "button", "aria-label": "Close the trial", onclick: () => close() }, "✕");
  const root = h("aside.drawer", { role: "dialog", "aria-modal": "false", "aria-label": `Trial`, "data-testid": "drawer", tabindex: "-1" }, closeButton, body);
  let curve = null;
  const before = document.activeElement;

  function close() {
    curve?.dispose();
    root.remove();
    document.removeEventListener("keydown", onKey);
    before?.focus?.();
    onClose?.();
  }
  function onKey(e) { if (e.key === "Escape") close(); }
  document.addEventListener("keydown", onKey);

  get(`trials/${trialId}`).then((t) => {
    root.setAttribute("aria-label", `Trial ${t.number}`);
    const params = Object.entries(t.params).map(([k, v]) => [k, fmtParam(v)]);
    const dl = (pairs) => h("dl", ...pairs.flatMap(([k, v]) => [h("dt", k), h("dd", v)]));
    const steps = Object.keys(t.intermediate_values).map(Number).sort((a, b) => a - b);
    const { state_dict: weights, resumed_at_epochs: resumed, ...userAttrs } = t.user_attrs ?? {};
    const canDownload = hasRoute("GET", "/api/v1/trials/{trial_id}/state_dict");
    const chart = h("div.chart", { "data-chart": "trial-curve", style: { height: "200px" } });
    clear(body).append(...[
      h("h2", `Trial #${t.number} `, h(`span.badge.${t.state}`, t.state)),
      dl([
        ["value", t.values && t.values.length > 1 ? t.values.map((v) => fmtValue(v)).join(", ") : fmtValue(t.value)],
        ["array", t.array_id ? h("a", { href: "#", onclick: (e) => { e.preventDefault(); onArray?.(t.array_id); close(); } }, `array ${t.array_id}`) : "–"],
        ["started", fmtDate(t.started_at)],
        ["duration", fmtDuration(elapsed(t.started_at, t.completed_at))],
        ["epochs", String(steps.length)],
        ...(resumed ? [["resumed at", Array.isArray(resumed) ? resumed.join(", ") : JSON.stringify(resumed)]] : []),
      ]),
      h("h3", "Params"), dl(params),
      h("h3", "Learning curve"), steps.length ? chart : h("p.muted", "No epoch reported yet."),
      t.error ? [h("h3", "Error"), h("pre.err", { "data-testid": "trial-error" }, t.error)] : null,
      Object.keys(userAttrs).length ? [h("h3", "User attrs"), h("div", { "data-testid": "trial-user-attrs" }, attrList(userAttrs))] : null,
      h("h3", "Weights"),
      weights
        ? canDownload
          ? h("button.primary", { type: "button", onclick: () => download(`/api/v1/trials/${t.id}/state_dict`, `trial-${t.number}.pt`) }, "Download state_dict")
          : h("p", "Saved at ", h("code", String(weights)), " (a plain torch state_dict).")
        : h("p.muted", t.state === "COMPLETE" ? "No weights were saved." : "Weights are saved when the trial completes."),
    ].flat().filter(Boolean));
    if (steps.length) {
      curve = upChart(chart, {
        legend: { show: false }, scales: { x: { time: false } },
        axes: [{ label: "epoch" }, { size: 56 }],
        series: [{}, { label: "value", stroke: "#2563eb", width: 2, points: { show: true, size: 4 } }],
      }, [steps, steps.map((s) => t.intermediate_values[s])]);
    }
  }).catch((err) => { clear(body).append(h("p.error", `Could not load trial ${trialId}: ${err.message}`)); });

  setTimeout(() => closeButton.focus(), 0);
  return { root, close };
}
