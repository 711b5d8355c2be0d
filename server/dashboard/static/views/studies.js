// The studies page: state, tenant, progress by trial state, best value, created and elapsed
// time, and the lifecycle actions the server offers (pause, resume, cancel, extend).

import { h, clear, STATES, STATE_COLOURS, fmtValue, fmtDate, fmtDuration, elapsed, announce } from "../util.js";
import { StudiesStore } from "../store.js";
import { hasRoute, request, ApiError } from "../api.js";

/** Lifecycle actions, offered where the server has the route (read from its OpenAPI document). */
export const ACTIONS = [
  { name: "pause", label: "Pause", when: (s) => s.state === "RUNNING" },
  { name: "resume", label: "Resume", when: (s) => s.state === "PAUSED" },
  { name: "extend", label: "Extend", when: (s) => ["RUNNING", "PAUSED", "COMPLETE"].includes(s.state), ask: true },
  { name: "cancel", label: "Cancel", when: (s) => ["RUNNING", "PAUSED"].includes(s.state), confirm: true, danger: true },
];

/** Extend is PATCH /studies/{id} {n_trials}; the others POST /studies/{id}/{action}. */
export function actionAvailable(name) {
  if (name === "extend") return hasRoute("PATCH", "/api/v1/studies/{study_id}");
  return hasRoute("POST", `/api/v1/studies/{study_id}/${name}`);
}

export async function runAction(study, action) {
  let body;
  if (action.ask) {
    const more = prompt(`Add how many trials to ${study.name} (now ${study.n_trials})?`, "10");
    if (!more || !/^\d+$/.test(more.trim())) return false;
    body = { n_trials: study.n_trials + Number(more) };
  }
  if (action.confirm && !confirm(`${action.label} study ${study.name}? Running trials stop at their next epoch.`)) return false;
  try {
    if (action.name === "extend") await request("PATCH", `studies/${study.id}`, { body });
    else await request("POST", `studies/${study.id}/${action.name}`);
    announce(`${action.label}: ${study.name}`);
    return true;
  } catch (err) {
    alert(`${action.label} failed: ${err instanceof ApiError ? err.message : err}`);
    return false;
  }
}

export function progressBar(study) {
  const counts = study.trial_counts || {};
  const total = Math.max(study.n_trials, STATES.reduce((n, s) => n + (counts[s] || 0), 0)) || 1;
  const bar = h("div.progress", { role: "img", "aria-label": STATES.map((s) => `${counts[s] || 0} ${s.toLowerCase()}`).join(", ") },
    ...["COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING"].map((s) =>
      h("span", { style: { width: `${(100 * (counts[s] || 0)) / total}%`, background: STATE_COLOURS[s] }, title: `${s}: ${counts[s] || 0}` })));
  const done = (counts.COMPLETE || 0) + (counts.PRUNED || 0) + (counts.FAIL || 0);
  const text = h("div.counts", { "data-testid": "counts" },
    `${done}/${study.n_trials} done · ${counts.RUNNING || 0} running · ${counts.WAITING || 0} waiting`
    + (counts.PRUNED ? ` · ${counts.PRUNED} pruned` : "") + (counts.FAIL ? ` · ${counts.FAIL} failed` : ""));
  return [bar, text];
}

export function bestText(study) {
  if (study.best_trial) return `${fmtValue(study.best_trial.value)} (#${study.best_trial.number})`;
  if (study.best_trials?.length) return `${study.best_trials.length} on the Pareto front`;
  return "–";
}

export function studiesView() {
  const store = new StudiesStore();
  const body = h("div");
  const root = h("div", h("div.toolbar", h("h1.grow", "Studies")), body);
  const filter = { text: "" };

  let tbody = null, countEl = null, lastJson = "";

  function build() {
    clear(body);
    const search = h("input", {
      type: "search", placeholder: "Filter by name, workload or tenant", "aria-label": "Filter studies",
      value: filter.text, oninput: (e) => { filter.text = e.target.value; renderRows(); },
    });
    tbody = h("tbody");
    countEl = h("span.muted");
    const table = h("table.studies", { "data-testid": "studies" },
      h("thead", h("tr", ...["Study", "State", "Tenant", "Progress", "Best", "Created", "Elapsed", "Actions"].map((c) => h("th", { scope: "col" }, c)))),
      tbody);
    body.append(h("div.toolbar", search, countEl), h("div.table-wrap", table));
  }

  function renderRows() {
    // Keep the keyboard focus on the same control across a refresh.
    const focused = document.activeElement?.closest?.("[data-study-id]") && document.activeElement.dataset.focusKey;
    clear(tbody);
    countEl.textContent = `${store.studies.length} studies`;
    const q = filter.text.toLowerCase();
    for (const s of store.studies) {
      if (q && !`${s.name} ${s.workload} ${s.tenant}`.toLowerCase().includes(q)) continue;
      const actions = ACTIONS.filter((a) => actionAvailable(a.name) && a.when(s)).map((a) =>
        h(`button${a.danger ? ".danger" : ""}`, {
          type: "button", "aria-label": `${a.label} ${s.name}`, "data-focus-key": `${s.id}:${a.name}`, "data-action": a.name,
          onclick: async () => { if (await runAction(s, a)) store.load(); },
        }, a.label));
      tbody.append(h("tr", { "data-study-id": s.id },
        h("td", h("a", { href: `#/studies/${s.id}`, "data-focus-key": `${s.id}:link` }, s.name), h("div.counts", `${s.workload} · ${s.directions?.length > 1 ? `${s.directions.length} objectives` : s.direction}`)),
        h("td", h(`span.badge.${s.state}`, { "data-testid": "state" }, s.state)),
        h("td", s.tenant),
        h("td", ...progressBar(s)),
        h("td", { "data-testid": "best" }, bestText(s)),
        h("td", fmtDate(s.created_at)),
        h("td", fmtDuration(elapsed(s.created_at, s.completed_at))),
        h("td", h("div.actions", actions.length ? actions : h("span.muted", "–"))),
      ));
    }
    if (focused) tbody.querySelector(`[data-focus-key="${focused}"]`)?.focus();
  }

  function render() {
    if (!store.loaded) { clear(body).append(h("p.muted", "Loading studies…")); return; }
    if (!store.studies.length) { tbody = null; lastJson = ""; clear(body).append(emptyState()); return; }
    const json = JSON.stringify(store.studies);
    if (tbody && json === lastJson) return;
    lastJson = json;
    if (!tbody) build();
    renderRows();
  }

  store.on((what) => { if (what === "studies") render(); });
  render();
  store.load().catch((err) => { clear(body).append(h("p.error", `Could not load studies: ${err.message}`)); });
  store.start();
  return { root, dispose: () => store.stop() };
}

function emptyState() {
  return h("div.empty", { "data-testid": "empty" },
    h("h2", "No studies yet"),
    h("p", "A study is a sweep of trials over a workload's search space; fusetune trains trials of the same shapes together as one fused array. Submit one and it shows up here as it runs, without reloading."),
    h("pre", `curl -H "Authorization: Bearer $FUSETUNE_TOKEN" -X POST ${location.origin}/api/v1/studies \\
  -d '{"workload": "digits-mlp", "n_trials": 16, "epochs": 10}'`),
    h("p", "Or from Python: ", h("code", "fusetune.client.Client().create_study(workload=\"digits-mlp\", n_trials=16)"),
      ". The API reference is at ", h("a", { href: "/docs" }, "/docs"), "."));
}
