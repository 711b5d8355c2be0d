"""The web dashboard in Debian's Chromium against a live sweep on a local Ray.

Every wait here waits for a state of the page (a selector, a text, a predicate on the DOM or
the canvases), never for a length of time; the generous timeouts only bound how long a
loaded machine may take to get there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dashboard.conftest import PARETO, SWEEP, Service, copy_shots

pytestmark = pytest.mark.slow

LONG = 600_000  # ms: how long a sweep on a loaded 2-core machine may take to get somewhere
ROOT = Path(__file__).resolve().parents[2]

#: True once every named chart has painted coloured pixels (series, not just grey axes) on one
#: of its canvases, or has an SVG path.
CHARTS_DRAWN = """(names) => names.every((name) => {
  const el = document.querySelector(`[data-chart="${name}"]`);
  if (!el) return false;
  if (el.querySelector("svg path")) return true;
  return [...el.querySelectorAll("canvas")].some((c) => {
    if (!c.width || !c.height) return false;
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    let coloured = 0;
    for (let i = 0; i < d.length; i += 4 * 7) {
      const [r, g, b, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
      if (a > 0 && Math.max(r, g, b) - Math.min(r, g, b) > 60) coloured++;
    }
    return coloured > 20;
  });
})"""


def login(page: Any, service: Service, token: str | None = None, path: str = "#/studies") -> None:
    page.goto(f"{service.url}/#token={token or service.token}")
    page.wait_for_selector("nav >> text=Log out")
    if path != "#/studies":
        page.evaluate("(h) => { location.hash = h; }", path)


def done_count(text: str) -> int:
    return int(re.match(r"(\d+)/\d+ done", text).group(1))


def test_pages_follow_a_live_sweep(service: Service, page: Any, browser: Any) -> None:
    """A new install's studies page reads as empty; a sweep submitted then appears, and its
    counts and the study page's change as its trials finish, without a reload."""
    login(page, service)
    page.wait_for_selector("[data-testid=empty] >> text=No studies yet")
    page.evaluate("window.__noReload = true")

    study_id = service.study(SWEEP)
    row = page.locator(f"tr[data-study-id='{study_id}']")
    row.wait_for()
    first = row.locator("[data-testid=counts]").inner_text()
    assert done_count(first) < SWEEP["n_trials"], f"the sweep had ended before the page first showed it: {first}"

    # The study page, in a second tab opened from the first (it gets a copy of the session
    # storage, so the token, as a browser's "open in new tab" does), while the trials train.
    listings: list[str] = []  # every request of the new tab for the study's trials list

    def listing(request: Any) -> None:
        if f"/studies/{study_id}/trials" in request.url and request.frame.page is not page:
            listings.append(request.url)

    # On the context, before the tab opens: a listener on the new page itself came too late for
    # its first request when the page loaded fast.
    page.context.on("request", listing)
    with page.context.expect_page() as opened:
        page.evaluate("(url) => window.open(url)", f"{service.url}/#/studies/{study_id}/progress")
    study_page = opened.value
    study_page.wait_for_selector("[data-testid=n-complete]")
    study_page.evaluate("window.__noReload = true")
    started_with = int(study_page.inner_text("[data-testid=n-complete]")) + int(study_page.inner_text("[data-testid=n-pruned]"))
    assert started_with < SWEEP["n_trials"]

    # Both pages get to the sweep's end by themselves.
    study_page.wait_for_function(
        "(n) => Number(document.querySelector('[data-testid=n-complete]').textContent)"
        " + Number(document.querySelector('[data-testid=n-pruned]').textContent) === n",
        arg=SWEEP["n_trials"], timeout=LONG,
    )
    page.wait_for_function(
        "([id, n]) => document.querySelector(`tr[data-study-id='${id}'] [data-testid=counts]`)?.textContent.startsWith(`${n}/${n} done`)",
        arg=[study_id, SWEEP["n_trials"]], timeout=LONG,
    )
    page.wait_for_function(
        "(id) => document.querySelector(`tr[data-study-id='${id}'] [data-testid=state]`)?.textContent === 'COMPLETE'",
        arg=study_id, timeout=LONG,
    )
    assert page.evaluate("window.__noReload") is True
    assert study_page.evaluate("window.__noReload") is True
    # The trials were downloaded once; every later read asked only for what changed since.
    whole = [u for u in listings if "updated_since=" not in u and "after=" not in u]
    assert len(whole) == 1 and len(listings) > 1, listings
    # The history has the best value the API reports.
    best = service.client.study(study_id)["best_trial"]
    study_page.wait_for_function(
        "(v) => document.querySelector('[data-testid=best]').textContent === v", arg=f"{best['value']:.4f}", timeout=LONG
    )
    study_page.close()


def test_every_chart_draws(service: Service, page: Any, shots_dir: Path) -> None:
    sweep = service.finished(SWEEP)
    pareto = service.finished(PARETO)
    names = service.client.trials(sweep)[0]["params"].keys()
    login(page, service, path=f"#/studies/{sweep}/progress")
    page.wait_for_function(CHARTS_DRAWN, arg=["history", "curves"], timeout=LONG)
    page.screenshot(path=str(shots_dir / "study-progress.png"), full_page=True)

    page.click("[data-tab=params]")
    slices = [f"slice-{n}" for n in names]
    page.wait_for_selector("[data-chart=importances]")
    page.wait_for_function(CHARTS_DRAWN, arg=["parallel", "importances", *slices], timeout=LONG)
    page.screenshot(path=str(shots_dir / "study-parameters.png"), full_page=True)

    page.click("[data-tab=trials]")
    page.wait_for_selector("[data-table=trials] .row")
    page.screenshot(path=str(shots_dir / "study-trials.png"))

    page.click("[data-tab=arrays]")
    page.wait_for_function(CHARTS_DRAWN, arg=["timeline"], timeout=LONG)
    page.screenshot(path=str(shots_dir / "study-arrays.png"), full_page=True)

    page.evaluate("(h) => { location.hash = h; }", f"#/studies/{pareto}/progress")
    page.wait_for_function(CHARTS_DRAWN, arg=["history", "curves", "pareto"], timeout=LONG)
    page.screenshot(path=str(shots_dir / "study-pareto.png"), full_page=True)

    page.evaluate("(h) => { location.hash = h; }", "#/cluster")
    page.wait_for_selector("[data-testid=devices] tr[data-device]")
    page.wait_for_function(CHARTS_DRAWN, arg=["shares"], timeout=LONG)
    page.screenshot(path=str(shots_dir / "cluster.png"), full_page=True)

    page.evaluate("(h) => { location.hash = h; }", "#/studies")
    page.wait_for_selector(f"tr[data-study-id='{pareto}']")
    page.screenshot(path=str(shots_dir / "studies.png"), full_page=True)


def foot(page: Any, table: str) -> tuple[int, int]:
    """(rows shown, trials) from the table's footer: 'N trials' or 'M of N trials'."""
    text = page.inner_text(f"[data-testid={table}-count]")
    m = re.fullmatch(r"(\d+) of (\d+) trials", text) or re.fullmatch(r"(\d+) trials", text)
    return (int(m.group(1)), int(m.group(2) if m.lastindex == 2 else m.group(1)))


def visible_numbers(page: Any, table: str) -> list[int]:
    return page.eval_on_selector_all(f"[data-table={table}] .row", "rows => rows.map(r => Number(r.dataset.number))")


def test_brushing_and_filters_change_the_rows(service: Service, page: Any, shots_dir: Path) -> None:
    sweep = service.finished(SWEEP)
    trials = service.client.trials(sweep)
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    login(page, service, path=f"#/studies/{sweep}/params")
    page.wait_for_function(CHARTS_DRAWN, arg=["parallel"], timeout=LONG)
    assert foot(page, "param-trials") == (len(trials), len(trials))

    # Brush the objective's axis (the last one) over its upper half: the best trials.
    box = page.locator("[data-chart=parallel]").bounding_box()
    x = box["x"] + box["width"] - 70  # the grid's right edge (parallel.right = 70)
    top, bottom = box["y"] + 30, box["y"] + box["height"] - 30
    page.mouse.move(x, top + 2)
    page.mouse.down()
    page.mouse.move(x, (top + bottom) / 2, steps=8)
    page.mouse.up()
    page.wait_for_selector("[data-testid=param-trials-brushed]")
    shown, total = foot(page, "param-trials")
    assert 0 < shown < len(complete) and total == len(trials), (shown, total)
    values = sorted((t["value"] for t in complete), reverse=True)
    brushed = {t["number"] for t in complete if t["value"] >= values[shown - 1]}
    assert set(visible_numbers(page, "param-trials")) == brushed
    page.screenshot(path=str(shots_dir / "study-parameters-brushed.png"), full_page=True)
    # The trials tab shows the same brush.
    page.click("[data-tab=trials]")
    page.wait_for_selector("[data-testid=trials-brushed]")
    assert foot(page, "trials")[0] == shown
    page.click("[data-testid=trials-brushed] >> text=clear")
    page.wait_for_function("(n) => document.querySelector('[data-testid=trials-count]').textContent === `${n} trials`", arg=len(trials))

    # Filters by state and by params.
    page.uncheck("[data-table=trials] input[data-state=PRUNED]")
    pruned = sum(t["state"] == "PRUNED" for t in trials)
    assert pruned, "the median pruner pruned none of the sweep's trials"
    page.wait_for_function("(n) => document.querySelector('[data-testid=trials-count]').textContent.startsWith(`${n} of`)", arg=len(trials) - pruned)
    page.check("[data-table=trials] input[data-state=PRUNED]")
    wide = sorted(t["number"] for t in trials if t["params"]["hidden"] == 64)
    assert 0 < len(wide) < len(trials)
    page.fill("[data-testid=trials-filter]", "hidden=64")
    page.wait_for_function("(n) => document.querySelector('[data-testid=trials-count]').textContent.startsWith(`${n} of`)", arg=len(wide))
    assert sorted(visible_numbers(page, "trials")) == wide  # every row is rendered at 24 trials

    # Sorting by value, descending: the first row is the best trial.
    page.fill("[data-testid=trials-filter]", "")
    page.click("[data-table=trials] [data-sort=value]")
    page.click("[data-table=trials] [data-sort=value]")
    best = service.client.study(sweep)["best_trial"]
    page.wait_for_function("(n) => document.querySelector('[data-table=trials] .row')?.dataset.number === String(n)", arg=best["number"])

    # A row opens the trial's drawer from the keyboard: its params, its curve, its array.
    page.focus("[data-table=trials] .row")
    page.keyboard.press("Enter")
    drawer = page.locator("[data-testid=drawer]")
    drawer.locator("text=\"Params\"").wait_for()
    assert f"Trial #{best['number']}" in drawer.inner_text()
    page.wait_for_function(CHARTS_DRAWN, arg=["trial-curve"], timeout=LONG)
    best_trial = next(t for t in trials if t["number"] == best["number"])
    assert f"array {best_trial['array_id']}" in drawer.inner_text()
    page.screenshot(path=str(shots_dir / "trial-drawer.png"))
    # Its weights download through the bearer header: the bytes the API serves.
    with page.expect_download() as download:
        drawer.locator("text=Download state_dict").click()
    saved = Path(download.value.path()).read_bytes()
    served = httpx.get(
        f"{service.url}/api/v1/trials/{best_trial['id']}/state_dict", headers={"Authorization": f"Bearer {service.token}"}
    )
    assert served.status_code == 200 and saved == served.content and len(saved) > 1000
    assert download.value.suggested_filename == f"trial-{best['number']}.pt"
    page.keyboard.press("Escape")
    drawer.wait_for(state="detached")


def test_the_studies_filter_keeps_the_studies_it_names(service: Service, page: Any) -> None:
    """The studies page's search box keeps the rows whose name, workload or tenant contains
    its text (case aside), and an empty box shows every study again."""
    pareto = service.study(PARETO)
    studies = service.client.studies()  # what this token sees, as the page does

    def matching(text: str) -> list[int]:
        return sorted(s["id"] for s in studies if text.lower() in f"{s['name']} {s['workload']} {s['tenant']}".lower())

    shown = (
        "(ids) => JSON.stringify([...document.querySelectorAll('[data-testid=studies] tbody tr[data-study-id]')]"
        ".map((t) => +t.dataset.studyId).sort((a, b) => a - b)) === JSON.stringify(ids)"
    )
    login(page, service)
    page.wait_for_function(shown, arg=matching(""))
    search = page.get_by_label("Filter studies")
    for text in ("DASHBOARD-PARETO", "digits-mlp", studies[0]["tenant"], "no study has this in its name", ""):
        search.fill(text)
        page.wait_for_function(shown, arg=matching(text))
    assert matching("DASHBOARD-PARETO") == [pareto] and matching("no study has this in its name") == []


def test_arrays_timeline_shows_the_arrays_and_their_members(service: Service, page: Any) -> None:
    sweep = service.finished(SWEEP)
    arrays = service.client.arrays(sweep)
    number = {t["id"]: t["number"] for t in service.client.trials(sweep)}
    assert len(arrays) >= 2
    login(page, service, path=f"#/studies/{sweep}/arrays")
    page.wait_for_selector("[data-testid=arrays] [data-array-id]")
    shown = page.eval_on_selector_all(
        "[data-testid=arrays] [data-array-id]",
        "cards => cards.map(c => [Number(c.dataset.arrayId), [...c.querySelectorAll('[data-trial-number]')].map(m => Number(m.dataset.trialNumber))])",
    )
    assert sorted(map(tuple, [(a, tuple(m)) for a, m in shown])) == sorted((a["id"], tuple(number[t] for t in a["trial_ids"])) for a in arrays)
    page.wait_for_function(CHARTS_DRAWN, arg=["timeline"], timeout=LONG)
    for a in arrays:
        card = page.locator(f"[data-array-id='{a['id']}']").inner_text()
        assert a["worker"] in card and "models·steps/s" in card


def test_no_token_shows_the_login_and_another_tenants_study_stays_out_of_reach(service: Service, page: Any) -> None:
    sweep = service.study(SWEEP)
    page.goto(f"{service.url}/#/studies/{sweep}/trials")
    page.wait_for_selector("form.login")
    assert page.locator("[data-study-id]").count() == 0
    # A wrong token is refused on the login page.
    page.fill("#token", "ft_not-a-token")
    page.click("form.login button[type=submit]")
    page.wait_for_selector("form.login [role=alert] >> text=not valid")

    # The rival tenant logs in: none of default's studies, and default's study by URL is missing.
    rival_study = service.rival.create_study(name="rival-study", workload="digits-mlp", n_trials=2, epochs=1)["id"]
    page.fill("#token", service.rival_token)
    page.click("form.login button[type=submit]")
    page.wait_for_selector(f"tr[data-study-id='{rival_study}']")
    assert page.locator(f"tr[data-study-id='{sweep}']").count() == 0
    assert "tenant: rival" in page.inner_text("[data-testid=who]")
    for tab in ("progress", "params", "trials", "arrays"):
        page.evaluate("(h) => { location.hash = h; }", f"#/studies/{sweep}/{tab}")
        page.wait_for_selector("[data-testid=not-found]")
        assert "does not exist" in page.inner_text("[data-testid=not-found]")
        assert SWEEP["name"] not in page.inner_text("main")
        page.evaluate("(h) => { location.hash = h; }", "#/studies")
        page.wait_for_selector(f"tr[data-study-id='{rival_study}']")
    # Logging out forgets the token: the page asks for one again, also after a reload.
    page.click("nav >> text=Log out")
    page.wait_for_selector("form.login")
    page.reload()
    page.wait_for_selector("form.login")
    assert page.evaluate("sessionStorage.length") == 0


def test_phone_width_and_the_keyboard(service: Service, browser: Any, shots_dir: Path) -> None:
    sweep = service.finished(SWEEP)
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    page = context.new_page()
    try:
        page.goto(f"{service.url}/#token={service.token}")
        page.wait_for_selector(f"tr[data-study-id='{sweep}']")
        # Nothing but the table's own scroller is wider than the screen.
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        page.screenshot(path=str(shots_dir / "phone-studies.png"), full_page=True)
        # From the top of the page, Tab reaches the study's link, and Enter opens it.
        for _ in range(40):
            page.keyboard.press("Tab")
            if page.evaluate("document.activeElement.dataset.focusKey") == f"{sweep}:link":
                break
        else:
            pytest.fail("the study's link is not reachable with Tab")
        page.keyboard.press("Enter")
        page.wait_for_selector("[data-testid=study-name]")
        page.wait_for_function(CHARTS_DRAWN, arg=["history", "curves"], timeout=LONG)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        page.screenshot(path=str(shots_dir / "phone-study.png"), full_page=True)
        # The tabs move with the arrow keys.
        page.focus("[data-tab=progress]")
        page.keyboard.press("ArrowRight")
        page.wait_for_selector("[data-tab=params][aria-selected=true]")
        assert page.evaluate("document.activeElement.dataset.tab") == "params"
    finally:
        context.close()


def test_screenshots_of_every_view(service: Service, shots_dir: Path) -> None:
    """Runs after the views' tests, which took the screenshots: all there, and real PNGs.
    FUSETUNE_DOCS_SCREENSHOTS=1 copies them into docs/img for docs/dashboard.md."""
    expected = {
        "studies", "study-progress", "study-parameters", "study-parameters-brushed", "study-trials",
        "trial-drawer", "study-arrays", "study-pareto", "cluster", "phone-studies", "phone-study",
    }
    found = {p.stem for p in shots_dir.glob("*.png")}
    assert expected <= found, expected - found
    for name in expected:
        assert (shots_dir / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("FUSETUNE_DOCS_SCREENSHOTS"):
        copy_shots(shots_dir, ROOT / "docs" / "img")
