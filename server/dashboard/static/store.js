// What the page knows of the server, kept current: the studies, and one study's trials.
//
// A study's trials are downloaded once (page by page where the server pages them), then kept
// current with only what changed: each event of the study's stream names the trial it is
// about, and the page asks for the trials changed since its cursor (`updated_since`), never
// for all of them again. Without an event stream it polls that cursor.

import { get, getPage, follow, hasRoute, routeTakes } from "./api.js";
import { setOwn } from "./util.js";

const POLL_MS = 2000;
const PAGE = 1000; // the API's largest page
const FIRST_PAGE = 100;
const CURVE_POINTS = 256; // learning curves come downsampled to about a chart's width

class Emitter {
  constructor() { this.listeners = new Set(); }
  on(fn) { this.listeners.add(fn); return () => this.listeners.delete(fn); }
  emit(...a) { for (const fn of this.listeners) fn(...a); }
}

/** The list of studies the token sees, kept current (tenant event stream, else polling). */
export class StudiesStore extends Emitter {
  constructor() {
    super();
    this.studies = [];
    this.loaded = false;
    this.stream = null;
    this.timer = null;
    this.stopped = false;
  }

  async load() {
    const studies = [];
    let page = await getPage("studies", routeTakes("GET", "/api/v1/studies", "limit") ? { limit: 1000 } : undefined);
    for (;;) {
      studies.push(...page.items);
      if (!page.next || !page.items.length || this.stopped) break;
      page = await getPage(page.next);
    }
    this.studies = studies;
    this.loaded = true;
    this.emit("studies");
  }

  start() {
    const refresh = coalesce(() => this.load().catch(() => {}));
    if (hasRoute("GET", "/api/v1/events")) {
      this.stream = follow("/api/v1/events", { onEvent: () => refresh(), onState: (s) => this.emit("stream", s) });
    }
    // Studies are few: the list is also polled, for what no event announces (a new study, a
    // state changed through the API).
    const tick = async () => {
      if (this.stopped) return;
      await refresh();
      this.timer = setTimeout(tick, this.stream ? POLL_MS * 2.5 : POLL_MS);
    };
    this.timer = setTimeout(tick, POLL_MS);
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.stream?.close();
  }
}

/** One running refresh at a time; a call during one runs once more after it. */
function coalesce(fn) {
  let running = null, again = false;
  const run = async () => {
    if (running) { again = true; return running; }
    running = (async () => {
      try { await fn(); } finally {
        running = null;
        if (again) { again = false; run(); }
      }
    })();
    return running;
  };
  return run;
}

/** One study and its trials. */
export class StudyStore extends Emitter {
  constructor(studyId) {
    super();
    this.id = studyId;
    this.study = null;
    this.trials = new Map(); // id -> trial
    this._list = []; // by number (trialList)
    this._index = new Map(); // id -> index in _list
    this._unsorted = false;
    this.distributions = {};
    this.cursor = null; // the updated_since cursor: the latest change seen
    this.lastEventAt = null;
    this.stream = null;
    this.timer = null;
    this.stopped = false;
    this.version = 0;
    this.complete = false; // every page of the first download is in
    this.loaded = null; // resolves then
    this.syncing = coalesce(() => this.sync());
  }

  /** Every trial by number. Kept in place as trials change: a changed trial replaces its old
   * entry, a new one goes at the end (numbers grow), so no change sorts them all again. */
  get trialList() {
    if (this._listVersion !== this.version) {
      if (this._unsorted) {
        this._list = [...this.trials.values()].sort((a, b) => a.number - b.number);
        this._index = new Map(this._list.map((t, i) => [t.id, i]));
        this._unsorted = false;
      }
      this._listVersion = this.version;
    }
    return this._list;
  }

  _place(t) {
    const i = this._index.get(t.id);
    if (i !== undefined) { this._list[i] = t; return; }
    const last = this._list[this._list.length - 1];
    if (!this._unsorted && (!last || last.number < t.number)) {
      this._index.set(t.id, this._list.length);
      this._list.push(t);
    } else {
      this._unsorted = true;
    }
  }

  /**
   * The study, and its trials page by page: resolves once the first page is in (the page is
   * usable from then on), `loaded` once every page is. Each page emits "trials".
   */
  async load() {
    this.study = await get(`studies/${this.id}`);
    this.emit("study");
    let first;
    const firstPage = new Promise((resolve) => { first = resolve; });
    this.loaded = this.fetchTrials(null, () => first()).then((changed) => {
      first();
      // Nothing read yet (a new study): the next poll asks for every change from revision 0.
      if (this.cursor === null && routeTakes("GET", "/api/v1/studies/{study_id}/trials", "updated_since")) this.cursor = 0;
      this.complete = true;
      this.emit("loaded", changed.length);
    });
    this.loaded.catch(() => first());
    await firstPage;
  }

  /**
   * The trials changed after revision `since` (all of them when null), page by page.
   *
   * Read in revision order, so a trial that changes while the pages are read comes again in
   * a later page (or in the next poll), and the highest revision read is a cursor that
   * misses nothing. A server without revisions or pages answers with the whole list.
   */
  async fetchTrials(since, onPage = null) {
    const path = `/api/v1/studies/{study_id}/trials`;
    const takes = (p) => routeTakes("GET", path, p);
    const params = {};
    // The first page of a first download is small, so the page draws at once; the others
    // are the API's largest (a cursor does not depend on the page size).
    if (takes("limit")) params.limit = since === null ? FIRST_PAGE : PAGE;
    if (takes("sort")) params.sort = "revision";
    if (takes("max_points")) params.max_points = CURVE_POINTS;
    if (since !== null && takes("updated_since")) params.updated_since = since;
    const changed = [];
    let page = await getPage(`studies/${this.id}/trials`, params);
    for (;;) {
      const items = page.items.map((t) => this.put(t));
      changed.push(...items);
      if (onPage) {
        if (items.length) { this.version++; this.emit("trials", items); }
        onPage(this.trials.size);
      }
      if (!page.next || !page.items.length || this.stopped) break;
      const next = new URL(page.next, location.origin);
      if (next.searchParams.has("limit")) next.searchParams.set("limit", String(PAGE));
      page = await getPage(next.pathname + next.search);
    }
    if (changed.length && !onPage) this.version++;
    return changed;
  }

  put(raw) {
    const old = this.trials.get(raw.id);
    if (raw.distributions && Object.keys(raw.distributions).length) {
      for (const [k, d] of Object.entries(raw.distributions)) if (!Object.hasOwn(this.distributions, k)) setOwn(this.distributions, k, d);
    }
    const t = {
      id: raw.id,
      number: raw.number,
      state: raw.state,
      value: raw.value,
      values: raw.values ?? null,
      params: raw.params ?? {},
      iv: raw.intermediate_values ?? old?.iv ?? {},
      hasCurve: false,
      array_id: raw.array_id,
      error: raw.error,
      created_at: raw.created_at,
      started_at: raw.started_at,
      completed_at: raw.completed_at,
      updated_at: raw.updated_at,
      state_dict: raw.user_attrs?.state_dict ?? old?.state_dict ?? null,
      revision: raw.revision ?? null,
    };
    if (t.revision !== null && (this.cursor === null || t.revision > this.cursor)) this.cursor = t.revision;
    for (const _ in t.iv) { t.hasCurve = true; break; }
    this.trials.set(t.id, t);
    this._place(t);
    return t;
  }

  async sync() {
    const [study, changed] = await Promise.all([
      get(`studies/${this.id}`),
      this.fetchTrials(this.cursor),
    ]);
    const studyChanged = JSON.stringify(study) !== JSON.stringify(this.study);
    this.study = study;
    if (studyChanged) this.emit("study");
    if (changed.length) this.emit("trials", changed);
  }

  start() {
    if (hasRoute("GET", "/api/v1/studies/{study_id}/events")) {
      this.stream = follow(`/api/v1/studies/${this.id}/events`, {
        onEvent: (message) => {
          this.lastEventAt = performance.now();
          this.emit("event", message);
          this.syncing().catch(() => {});
        },
        onState: (s) => this.emit("stream", s),
      });
    }
    const tick = async () => {
      if (this.stopped) return;
      if (!this.stream) await this.syncing().catch(() => {});
      this.timer = setTimeout(tick, this.stream ? POLL_MS * 15 : POLL_MS);
    };
    this.timer = setTimeout(tick, POLL_MS);
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.stream?.close();
  }
}
