// One study: its head (state, progress, actions) and the tabs progress, parameters, trials
// and arrays. The trials are loaded once, then kept current from the event stream and the
// updated_since cursor; the visible tab repaints once per frame at most.

import { h, clear, attrList, fmtDate, fmtDuration, elapsed, perFrame, announce } from "../util.js";
import { StudyStore } from "../store.js";
import { ApiError } from "../api.js";
import { progressBar, bestText, actionAvailable, runAction, ACTIONS } from "./studies.js";
import { progressTab } from "./progress.js";
import { paramsTab } from "./params.js";
import { trialsTab, trialDrawer } from "./trials.js";
import { arraysTab } from "./arrays.js";

const TABS = [
  { id: "progress", label: "Progress", make: progressTab },
  { id: "params", label: "Parameters", make: paramsTab },
  { id: "trials", label: "Trials", make: trialsTab },
  { id: "arrays", label: "Arrays", make: arraysTab },
];


export function studyView(studyId, initialTab) {
  const store = new StudyStore(studyId);
  const head = h("div.study-head");
  const tabBar = h("div.tabs", { role: "tablist", "aria-label": "Study views" });
  const panes = h("div");
  const root = h("div", { "data-study-id": studyId }, head, tabBar, panes);
  const made = new Map(); // tab id -> {root, update, dispose}
  let active = null;
  let drawer = null;
  let selection = null;
  const dirty = new Set();
  const building = new Set();
  const waiting = new Map(); // tab id -> callbacks for when it is built
  function whenTab(id, fn) {
    if (made.has(id)) fn(made.get(id));
    else waiting.set(id, [...(waiting.get(id) ?? []), fn]);
  }
  let disposed = false;
  let attrsOpen = false; // the head's user attrs, opened by the user, stay open across repaints

  const ctx = {
    store,
    openTrial(id) {
      drawer?.close();
      drawer = trialDrawer(id, {
        onClose: () => { drawer = null; },
        onArray: (arrayId) => { location.hash = `#/studies/${studyId}/arrays`; whenTab("arrays", (tab) => tab.focusArray(arrayId)); },
      });
      document.body.append(drawer.root);
    },
    setSelection(ids) {
      selection = ids;
      made.get("trials")?.setSelection(ids);
    },
  };

  for (const t of TABS) {
    tabBar.append(h("a", {
      href: `#/studies/${studyId}/${t.id}`, role: "tab", id: `tab-${t.id}`, "data-tab": t.id, "aria-controls": `pane-${t.id}`,
      onkeydown: (e) => {
        if (e.key !== "ArrowRight" && e.key !== "ArrowLeft") return;
        const i = TABS.findIndex((x) => x.id === t.id) + (e.key === "ArrowRight" ? 1 : -1);
        const next = TABS[(i + TABS.length) % TABS.length];
        location.hash = `#/studies/${studyId}/${next.id}`;
        document.getElementById(`tab-${next.id}`)?.focus();
      },
    }, t.label));
  }

  function renderHead() {
    const s = store.study;
    const actions = ACTIONS.filter((a) => actionAvailable(a.name) && a.when(s)).map((a) =>
      h(`button${a.danger ? ".danger" : ""}`, { type: "button", onclick: async () => { if (await runAction(s, a)) store.syncing(); } }, a.label));
    clear(head).append(...[
      h("h1", { "data-testid": "study-name" }, s.name),
      h(`span.badge.${s.state}`, { "data-testid": "study-state" }, s.state),
      h("div", ...progressBar(s)),
      h("span.meta", `${s.workload} · tenant ${s.tenant} · best ${bestText(s)} · created ${fmtDate(s.created_at)} · ${fmtDuration(elapsed(s.created_at, s.completed_at))}`),
      store.complete ? null : h("span.meta", { "data-testid": "loading" }, `loading trials: ${store.trials.size.toLocaleString()} read`),
      h("div.actions", actions),
      s.error ? h("p.error.study-error", { "data-testid": "study-error" }, s.error) : null,
      // How fusion trains it, where it could not do its best (a module run once per member, a
      // model trained unfused): text, as the service wrote it.
      s.warnings?.length
        ? h("ul.study-warnings", { "data-testid": "study-warnings" }, ...s.warnings.map((w) => h("li", w)))
        : null,
      Object.keys(s.user_attrs ?? {}).length
        ? h("details.attrs", { "data-testid": "study-user-attrs", open: attrsOpen, ontoggle: (e) => { attrsOpen = e.target.open; } },
          h("summary", `user attrs (${Object.keys(s.user_attrs).length})`), attrList(s.user_attrs))
        : null,
    ].filter(Boolean));
    document.title = `fusetune · ${s.name}`;
  }

  function showTab(id, { now = false } = {}) {
    if (!TABS.some((t) => t.id === id)) id = "progress";
    active = id;
    for (const a of tabBar.children) a.setAttribute("aria-selected", String(a.dataset.tab === id));
    for (const pane of panes.children) pane.hidden = pane.dataset.pane !== id;
    if (!store.study) return;
    let tab = made.get(id);
    if (!tab && !building.has(id)) {
      // The tab's selection shows at once; its charts are built in the next task, so the
      // click is answered within the frame however many trials they draw.
      const pane = h("div", { role: "tabpanel", id: `pane-${id}`, "data-pane": id, "aria-labelledby": `tab-${id}` },
        h("p.muted", "Drawing…"));
      panes.append(pane);
      building.add(id);
      const build = () => {
        building.delete(id);
        if (disposed) return;
        const made_ = TABS.find((t) => t.id === id).make(ctx);
        made.set(id, made_);
        clear(pane).append(made_.root);
        pane.hidden = active !== id;
        if (id === "trials" && selection) made_.setSelection(selection);
        made_.update();
        dirty.delete(id);
        for (const fn of waiting.get(id) ?? []) fn(made_);
        waiting.delete(id);
      };
      // The first tab is built at once, with the page; a tab clicked later in the next task.
      if (now) build();
      else requestAnimationFrame(() => setTimeout(build, 0));
    } else if (tab && dirty.has(id)) {
      dirty.delete(id);
      tab.update();
    }
  }

  // While the first download runs, repaint at most every 400 ms: each repaint reads every
  // trial read so far, and the page must stay responsive between them.
  let lastPaint = 0, lastPaintMs = 0, pending = null;
  const paintNow = perFrame(() => {
    lastPaint = performance.now();
    if (!store.study) return;
    renderHead();
    for (const id of made.keys()) dirty.add(id);
    const started = performance.now();
    const tab = made.get(active);
    if (!tab) return; // the stamps below mean "the tab's charts are on screen"
    if (tab) { dirty.delete(active); tab.update(); }
    const took = performance.now() - started;
    lastPaintMs = took;
    const version = store.version;
    // Once the frame with this repaint is on screen: when (epoch ms) and how long the repaint
    // took (benchmarks/dashboard.py reads these).
    requestAnimationFrame(() => requestAnimationFrame(() => {
      root.dataset.version = String(version);
      root.dataset.paintMs = took.toFixed(1);
      root.dataset.paintedAt = String(performance.timeOrigin + performance.now());
    }));
  });
  function repaint() {
    if (store.complete) { paintNow(); return; }
    if (pending) return;
    // At least 400 ms apart, and four times as long as the last repaint took: the main
    // thread stays at least 80% free for the user while the pages come in.
    const gap = Math.max(400, 4 * lastPaintMs);
    pending = setTimeout(() => { pending = null; paintNow(); }, Math.max(0, gap - (performance.now() - lastPaint)));
  }

  store.on((what) => { if (what === "study" || what === "trials") repaint(); });
  store.on((what, s) => {
    if (what !== "stream") return;
    const el = document.getElementById("stream-state");
    if (el) el.textContent = s === "open" ? "● live" : s === "retrying" ? "○ reconnecting" : "";
  });

  store.on((what, n) => {
    if (what !== "loaded") return;
    root.dataset.loaded = "true";
    store.start(); // from the highest revision read: only what changes from now on
    repaint();
  });
  store.load().then(() => {
    renderHead();
    showTab(active ?? initialTab, { now: true });
    paintNow(); // stamps the first frame with the tab drawn
    root.dataset.version = String(store.version);
  }).catch((err) => {
    clear(root).append(h("div.empty", { "data-testid": "not-found" },
      h("h2", err instanceof ApiError && err.status === 404 ? `Study ${studyId} does not exist` : "Could not load the study"),
      h("p", err instanceof ApiError && err.status === 404
        ? "There is no such study among those your token may read."
        : err.message),
      h("p", h("a", { href: "#/studies" }, "Back to the studies"))));
    announce("Study not found");
  });
  active = initialTab;
  clear(panes);
  for (const a of tabBar.children) a.setAttribute("aria-selected", String(a.dataset.tab === initialTab));

  return {
    root,
    studyId,
    showTab,
    store,
    dispose() {
      disposed = true;
      clearTimeout(pending);
      store.stop();
      drawer?.close();
      for (const tab of made.values()) tab.dispose();
    },
  };
}
