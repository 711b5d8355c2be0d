"""The web dashboard at 100,000 trials, in Debian's Chromium (Playwright), on PostgreSQL.

    python benchmarks/dashboard.py                       # base URL: $FUSETUNE_TEST_POSTGRES_URL, else local postgres
    python benchmarks/dashboard.py --trials 20000 --updates 10 --json out.json

It makes a scratch database (dropped at the end), seeds a study of ``--trials`` trials with
``--steps`` intermediate values each by bulk SQL inserts into Optuna's and fusetune's tables (the
last 100 WAITING, the others COMPLETE), starts the real server (uvicorn, the API only), logs in as
the study's tenant and measures, with the browser's own clocks (Playwright evaluates
``performance.now()`` and reads what the page stamps after each repaint's frame):

1. ``study page interactive``: from the navigation's start to the study page drawn from the
   first page of trials (head, counts, the history chart with points) and answering a click
   (the Parameters tab selected); then how long until every trial is in, page by page, with
   the page repainting as they come.
2. ``live update painted``: ``--updates`` times, one WAITING trial ends COMPLETE with a new best
   value and its ``trial.ended`` event is stored in the same transaction, as the scheduling
   loop writes them; the latency is from that commit to the frame that shows the new best
   (the page follows the study's event stream and reads the trials changed since its
   ``updated_since`` cursor).
3. ``memory``: the page's JS heap (after a forced garbage collection) and DOM nodes (Chrome
   DevTools Protocol ``Performance.getMetrics``) once loaded, after the updates, after the
   trials table was scrolled from top to bottom, and after every tab was shown twice.

Nothing asserts a speed: the table says what was measured against the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the repository root, for benchmarks._bigstudy
from benchmarks._bigstudy import api_server, create_studies, machine, percentile, scratch_database, seed_trials, vacuum  # noqa: E402

DEFAULT_BASE = os.environ.get("FUSETUNE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
CHROMIUM = "/usr/bin/chromium"
TARGETS = {"interactive_s": 2.0, "update_s": 1.0}
ROWS_KEY = "rows in the DOM at the end of the table"


#: Watches a study page for its first paint (the stamp the page sets after the frame), then
#: clicks the Parameters tab at once and times the answer (the tab shown selected, a frame later).
PROBE = """
if (location.hash.startsWith("#/studies/")) {
  window.__probe = {};
  const watch = new MutationObserver(() => {
    const root = document.querySelector("[data-study-id][data-painted-at]");
    if (!root || window.__probe.painted || !document.querySelector("[data-chart=history] canvas")) return;
    watch.disconnect();
    window.__probe.painted = performance.now();
    const tab = document.querySelector("[data-tab=params]");
    window.__probe.clicked = performance.now();
    tab.click();
    const check = () => tab.getAttribute("aria-selected") === "true"
      ? requestAnimationFrame(() => { window.__probe.answered = performance.now(); }) : requestAnimationFrame(check);
    check();
  });
  document.addEventListener("DOMContentLoaded", () => watch.observe(document.body, { subtree: true, attributes: true, childList: true }));
}
"""


def heap(cdp: Any) -> dict[str, float]:
    cdp.send("HeapProfiler.collectGarbage")
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return {"js_heap_mb": metrics["JSHeapUsedSize"] / 2**20, "dom_nodes": metrics["Nodes"]}


def end_trial_with_event(url: str, study_id: int, value: float) -> float:
    """One WAITING trial of the study ends COMPLETE with ``value``, and its trial.ended event, in
    one transaction (as the coordinator records a member that completed). Returns the commit's
    wall-clock time."""
    import optuna
    from sqlalchemy import select

    from fusetune.server import events
    from fusetune.server.db import Study, Trial, TrialState, get_optuna_storage, get_sessionmaker, utcnow

    storage = get_optuna_storage(url)
    with get_sessionmaker(url)() as session:
        trial = session.scalars(
            select(Trial).where(Trial.study_id == study_id, Trial.state == TrialState.WAITING).order_by(Trial.id).limit(1)
        ).one()
        tenant = session.get(Study, study_id).tenant
        storage.set_trial_state_values(trial.optuna_trial_id, optuna.trial.TrialState.COMPLETE, [value])
        trial.state, trial.value, trial.completed_at = TrialState.COMPLETE, value, utcnow()
        events.record(session, "trial.ended", tenant=tenant, study_id=study_id, trial_id=trial.id, state="COMPLETE", value=value)
        session.commit()
        return time.time()


def run(args: argparse.Namespace) -> dict[str, Any]:
    with scratch_database(args.base_url, "fusetune_dash") as url:
        return measure(args, url)


def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    from fusetune.server import tenants
    from fusetune.server.db import get_engine, get_sessionmaker

    results: dict[str, Any] = {"trials": args.trials, "steps": args.steps}
    study_id, optuna_id = create_studies(url, ["big"], 100_000)["big"]
    started = time.perf_counter()
    with get_engine(url).begin() as conn:
        seed_trials(conn, (study_id, optuna_id), args.trials, args.steps, waiting=100)
    vacuum(url)
    results["seed_s"] = time.perf_counter() - started
    print(f"seeded {args.trials} trials x {args.steps} values in {results['seed_s']:.1f} s", flush=True)
    with get_sessionmaker(url)() as session:
        token = tenants.create_token(session, "default", "benchmark").token

    env = {"FUSETUNE_ADMIN_TOKEN": secrets.token_urlsafe(32), "FUSETUNE_EVENTS_POLL_INTERVAL_S": str(args.events_poll_s)}
    with api_server(url, args.server_workers, env) as base:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM)
            context = browser.new_context(viewport={"width": 1280, "height": 800})
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.set_default_timeout(args.timeout_s * 1000)
            context.add_init_script(PROBE)
            cdp = context.new_cdp_session(page)
            cdp.send("Performance.enable")
            # Log in (the token goes to session storage), and load the page's code once, as a
            # returning user's browser has it.
            page.goto(f"{base}/#token={token}")
            page.wait_for_selector(f"tr[data-study-id='{study_id}']")

            # 1. The study page, from navigation start.
            runs = []
            for attempt in range(args.repeat):
                page.goto(f"{base}/?run={attempt}#/studies/{study_id}/progress")
                # PROBE (an init script) clicks the Parameters tab the moment the study page
                # first paints, and notes when the click is answered: no round trip to this
                # process is counted.
                page.wait_for_function("() => window.__probe && window.__probe.answered")
                drawn, clicked_at, answered = page.evaluate("[window.__probe.painted, window.__probe.clicked, window.__probe.answered]")
                clicked = [clicked_at, answered]
                page.evaluate("location.hash = location.hash.replace('/params', '/progress')")
                page.wait_for_selector("[data-study-id][data-loaded=true]")
                loaded = page.evaluate("performance.now()")
                n_read = page.evaluate("Number(document.querySelector('[data-testid=n-complete]').textContent)")
                runs.append({
                    "first_paint_s": drawn / 1000, "click_answered_s": (clicked[1] - clicked[0]) / 1000,
                    "interactive_s": max(drawn, clicked[1]) / 1000, "all_trials_s": loaded / 1000, "complete_shown": n_read,
                })
                print(f"study page: {runs[-1]}", flush=True)
            results["study page"] = runs
            results["memory loaded"] = heap(cdp)

            # 2. Live updates: a new best each time.
            page.wait_for_selector("[data-study-id][data-loaded=true]")
            page.wait_for_function("() => document.getElementById('stream-state')?.textContent.includes('live')")
            latencies = []
            paint_ms = []
            for k in range(args.updates):
                value = round(1.0 + (k + 1) / 1000, 4)
                committed = end_trial_with_event(url, study_id, value)
                page.wait_for_function(
                    "(v) => document.querySelector('[data-testid=best]')?.textContent === v", arg=f"{value:.4f}"
                )
                page.wait_for_function(
                    "(t) => Number(document.querySelector('[data-study-id]').dataset.paintedAt) > t", arg=committed * 1000
                )
                painted = page.evaluate("Number(document.querySelector('[data-study-id]').dataset.paintedAt)")
                paint_ms.append(page.evaluate("Number(document.querySelector('[data-study-id]').dataset.paintMs)"))
                latencies.append(painted / 1000 - committed)
                time.sleep(args.update_gap_s)  # the next update is a separate event, not the same burst
            results["live update"] = {"n": len(latencies), "latencies_s": latencies, "repaint_ms": paint_ms}
            results["memory after updates"] = heap(cdp)
            if args.screenshot:
                page.screenshot(path=args.screenshot, full_page=True)

            # 3. The table scrolled end to end, every tab twice.
            page.click("[data-tab=trials]")
            page.wait_for_selector("[data-table=trials] .row")
            page.evaluate(
                """async () => {
                  const s = document.querySelector('[data-table=trials] .scroller');
                  for (let y = 0; y <= s.scrollHeight; y += s.clientHeight * 20) {
                    s.scrollTop = y; await new Promise((r) => requestAnimationFrame(r));
                  }
                  s.scrollTop = s.scrollHeight; await new Promise((r) => requestAnimationFrame(r));
                }"""
            )
            results[ROWS_KEY] = page.eval_on_selector_all("[data-table=trials] .row", "r => r.length")
            results["memory after scrolling the table"] = heap(cdp)
            for _ in range(2):
                for tab in ("progress", "params", "trials", "arrays"):
                    page.click(f"[data-tab={tab}]")
                    page.wait_for_selector(f"[data-tab={tab}][aria-selected=true]")
                    page.wait_for_function("() => new Promise((r) => requestAnimationFrame(() => r(true)))")
            results["memory after every tab twice"] = heap(cdp)
            results["page errors"] = errors
            browser.close()
    return results


def table(results: dict[str, Any]) -> str:
    runs = results["study page"]
    lines = [f"{results['trials']:,} trials x {results['steps']} intermediate values (seeded in {results['seed_s']:.0f} s)"]
    best = min(r["interactive_s"] for r in runs)
    worst = max(r["interactive_s"] for r in runs)
    ok = "met" if worst <= TARGETS["interactive_s"] else "NOT met"
    lines.append(
        f"study page interactive: {best:.2f} to {worst:.2f} s over {len(runs)} loads (first paint "
        f"{min(r['first_paint_s'] for r in runs):.2f}-{max(r['first_paint_s'] for r in runs):.2f} s, a click answered in "
        f"{max(r['click_answered_s'] for r in runs) * 1000:.0f} ms at most)  target <= 2 s: {ok}"
    )
    lines.append(
        f"every trial in the page: {min(r['all_trials_s'] for r in runs):.1f} to {max(r['all_trials_s'] for r in runs):.1f} s"
    )
    live = results["live update"]
    p50, p95, mx = (percentile(live["latencies_s"], 50), percentile(live["latencies_s"], 95), max(live["latencies_s"]))
    ok = "met" if mx <= TARGETS["update_s"] else "NOT met"
    lines.append(
        f"live update painted after the event's commit: p50 {p50 * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, max {mx * 1000:.0f} ms "
        f"over {live['n']} (repaint p50 {percentile(live['repaint_ms'], 50):.0f} ms)  target <= 1 s: {ok}"
    )
    for key in ("memory loaded", "memory after updates", "memory after scrolling the table", "memory after every tab twice"):
        m = results[key]
        lines.append(f"{key}: JS heap {m['js_heap_mb']:.0f} MiB, {m['dom_nodes']:.0f} DOM nodes")
    lines.append(f"trial rows in the DOM with the table scrolled to its end: {results[ROWS_KEY]}")
    if results["page errors"]:
        lines.append(f"page errors: {results['page errors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=DEFAULT_BASE, help="a PostgreSQL server: the scratch database is made there")
    parser.add_argument("--trials", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3, help="loads of the study page")
    parser.add_argument("--updates", type=int, default=20)
    parser.add_argument("--update-gap-s", type=float, default=0.5)
    parser.add_argument("--events-poll-s", type=float, default=0.25, help="the server's FUSETUNE_EVENTS_POLL_INTERVAL_S")
    parser.add_argument("--server-workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--screenshot", help="a PNG of the study page after the updates")
    args = parser.parse_args(argv)
    about = machine()
    print(about, flush=True)
    results = run(args)
    results["machine"] = about
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
