"""A hostile tenant's strings in the dashboard, opened by the admin in Debian's Chromium.

A tenant controls its studies' param names and categorical choices (``search_space``), its
user attrs (the study's and an enqueued trial's), and through them the error texts of trials
its params break; a study's name is stored text too. Every one of them here is an HTML or
JavaScript payload that would call ``window.__xss`` if the page ever parsed it as markup. The
admin opens both studies on every tab, every ECharts tooltip is shown (``showTip`` on every
series and every point), every trial's drawer opened, and then:

* no payload ran (``window.__xss`` counts calls);
* no payload was parsed into the page at all: a MutationObserver flags every element carrying
  the payloads' ``data-xss`` attribute, an ``on*`` handler attribute or a ``javascript:`` URL,
  and the Content-Security-Policy reported no violation (so the text rendering protects by
  itself, not the policy);
* the payloads were shown, as text: in the tooltips, the tables, the drawers, the study heads.

And the page, its static files and the API's answers send the Content-Security-Policy, which
refuses an inline handler in the page.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import optuna
import pytest
import sqlalchemy as sa

from fusetune.client import FusetuneError
from tests.dashboard.conftest import Service
from tests.dashboard.test_dashboard import LONG, foot, login, visible_numbers

pytestmark = pytest.mark.slow
D = optuna.distributions

#: Each calls window.__xss(name) if parsed as HTML (or followed as a URL), and carries data-xss.
#: No single quotes: Python's repr of a value in an error text would escape them.
IMG = """<img src=x data-xss onerror="__xss(`img`)">"""
SCRIPT = """<script data-xss>__xss(`script`)</script>"""
SVG = """"><svg data-xss onload="__xss(`svg`)">"""
JS_URL = """javascript:__xss(`url`)//"""
LINK = """<a data-xss href="javascript:__xss(`a`)">click</a>"""
#: ECharts' rich text syntax ({style|text}) around markup: plain text unless an option defines
#: `rich` styles, and markup that must not reach a tooltip.
RICH = """{a|<img src=y data-xss onerror="__xss(`rich`)">}{b|x}"""

#: Param names and categorical choices. `hidden` is the one the digits MLP reads: its payload
#: choice fails the trial at once (int() of it), with the payload in the trial's error.
SEARCH_SPACE = {
    "hidden": D.CategoricalDistribution([32, 48, 64, IMG]),
    IMG: D.FloatDistribution(0.0, 1.0),
    SVG: D.CategoricalDistribution([SCRIPT, JS_URL, RICH, LINK]),
    RICH: D.IntDistribution(1, 9),
}
PAYLOAD_STUDY: dict[str, Any] = {
    "name": "xss-payloads",
    "workload": "digits-mlp",
    "n_trials": 10,
    "epochs": 2,
    "max_array_size": 4,
    "sampler": {"name": "RandomSampler", "kwargs": {"seed": 5}},
    "search_space": {name: D.distribution_to_json(d) for name, d in SEARCH_SPACE.items()},
}
#: Every trial fails: the study ends FAILED with an error that quotes the payload.
FAILED_STUDY: dict[str, Any] = {
    "name": "xss-failed",
    "workload": "digits-mlp",
    "n_trials": 2,
    "epochs": 1,
    "search_space": {"hidden": D.distribution_to_json(D.CategoricalDistribution([SVG]))},
}
#: The API refuses such names; the studies' rows are renamed in the database, as a name stored
#: by any other path (an older server, a migration, a looser rule later) would read.
PAYLOAD_NAME = IMG + SCRIPT
FAILED_NAME = SVG + LINK
STUDY_ATTRS = {IMG: SCRIPT, RICH: {"nested": [SVG, JS_URL]}}
#: A study warning names a module by its path, which an nn.ModuleDict's key can make anything.
WARNING = f"submodule 'blocks.{IMG}' (Gate) runs once per member, exact but without fusion's speed-up ({SCRIPT})"
TRIAL_ATTRS = {SVG: IMG, "link": JS_URL, "rich": RICH}

#: Installed before the page's scripts: the execution counter, the CSP violation log, and a
#: MutationObserver that flags every element a payload would have put in the page.
WATCH = """(() => {
  window.__pwned = 0;
  window.__pwnedBy = [];
  window.__xss = (what) => { window.__pwned += 1; window.__pwnedBy.push(what); };
  const violations = [];
  document.addEventListener("securitypolicyviolation",
    (e) => violations.push(`${e.violatedDirective} ${e.blockedURI} ${e.sample}`));
  const injected = [];
  const hostile = (el) => el.hasAttribute("data-xss") || [...el.attributes].some(
    (a) => a.name.toLowerCase().startsWith("on") || /^\\s*javascript:/i.test(a.value));
  const check = (el) => {
    if (!(el instanceof Element)) return;
    for (const e of [el, ...el.querySelectorAll("*")]) if (hostile(e)) injected.push(e.outerHTML.slice(0, 200));
  };
  const take = (records) => {
    for (const r of records) {
      if (r.type === "attributes") check(r.target);
      else r.addedNodes.forEach(check);
    }
  };
  const observer = new MutationObserver(take);
  observer.observe(document, { subtree: true, childList: true, attributes: true });
  window.__xssReport = () => {
    take(observer.takeRecords());
    return { pwned: window.__pwned, by: window.__pwnedBy, injected, violations };
  };
})();"""

#: Every ECharts instance in the page (by its container, [data-chart]): showTip on every point
#: of every series; returns {chart: {shown, texts}} with the distinct texts the tooltip showed.
SHOW_EVERY_TIP = """async () => {
  const echarts = await import("/dashboard/vendor/echarts-6.1.0/echarts.esm.min.js");
  const out = {};
  for (const el of document.querySelectorAll("[data-chart]")) {
    const chart = echarts.getInstanceByDom(el);
    if (!chart) continue;
    const texts = new Set();
    let shown = 0;
    (chart.getOption().series || []).forEach((series, seriesIndex) => {
      const n = Array.isArray(series.data) ? series.data.length : 0;
      for (let dataIndex = 0; dataIndex < n; dataIndex++) {
        chart.dispatchAction({ type: "showTip", seriesIndex, dataIndex });
        shown++;
        const tip = el.textContent.trim();  // the tooltip is the container's only text
        if (tip) texts.add(tip);
      }
    });
    chart.dispatchAction({ type: "hideTip" });
    out[el.dataset.chart] = { shown, texts: [...texts] };
  }
  return out;
}"""

#: True once every named chart has painted coloured pixels on one of its canvases.
DRAWN = """(names) => names.every((name) => {
  const el = document.querySelector(`[data-chart="${CSS.escape(name)}"]`);
  if (!el) return false;
  return [...el.querySelectorAll("canvas")].some((c) => {
    if (!c.width || !c.height) return false;
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    let coloured = 0;
    for (let i = 0; i < d.length; i += 4 * 7) {
      if (d[i + 3] > 0 && Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 60) coloured++;
    }
    return coloured > 20;
  });
})"""

REQUIRED_CSP = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "object-src": ["'none'"],
    "base-uri": ["'none'"],
    "frame-ancestors": ["'none'"],
    "connect-src": ["'self'"],
    "form-action": ["'self'"],
}


def csp(headers: httpx.Headers) -> dict[str, list[str]]:
    policy = headers.get("content-security-policy")
    assert policy, f"no Content-Security-Policy in {dict(headers)}"
    out = {}
    for directive in filter(None, (d.strip() for d in policy.split(";"))):
        name, *values = directive.split()
        out[name.lower()] = values
    return out


def payload_studies(service: Service) -> tuple[int, int]:
    """The two hostile studies, trained to their end and renamed; (payload study, failed study)."""
    client = service.client
    if PAYLOAD_STUDY["name"] in service.studies:
        return service.studies[PAYLOAD_STUDY["name"]], service.studies[FAILED_STUDY["name"]]
    study = service.study(PAYLOAD_STUDY)
    failed = service.study(FAILED_STUDY)
    headers = {"Authorization": f"Bearer {service.token}"}
    for key, value in STUDY_ATTRS.items():
        url = f"{service.url}/api/v1/studies/{study}/user_attrs/{quote(key, safe='')}"
        r = httpx.put(url, json={"value": value}, headers=headers)
        assert r.status_code == 200, r.text
    # A trial of the tenant's own, with payload user attrs and the payload width: it fails with
    # the payload in its error. Enqueued while the study is paused, so that the loop asks
    # nothing meanwhile: with room made first if the loop had asked every trial already.
    for _ in range(20):
        state = client.study(study)["state"]
        if state == "PAUSED":
            break
        if state == "COMPLETE":  # it ended before the pause: one more trial, and it runs again
            client.update_study(study, n_trials=client.study(study)["n_trials"] + 1)
        try:
            client.pause_study(study)
        except FusetuneError as exc:
            assert exc.status_code == 409, exc
    assert client.study(study)["state"] == "PAUSED"
    asked = len(client.trials(study))
    if asked >= client.study(study)["n_trials"]:
        client.update_study(study, n_trials=asked + 1)
    r = httpx.post(
        f"{service.url}/api/v1/studies/{study}/trials",
        json={"params": {"hidden": IMG}, "user_attrs": TRIAL_ATTRS},
        headers=headers,
    )
    assert r.status_code == 201, r.text
    client.resume_study(study)
    assert client.wait(study, timeout=LONG / 1000, poll=1.0)["state"] == "COMPLETE"
    assert client.wait(failed, timeout=LONG / 1000, poll=1.0)["state"] == "FAILED"

    trials = client.trials(study)
    assert sum(t["state"] == "COMPLETE" for t in trials) >= 2, trials
    assert any(t["state"] == "FAIL" and IMG in t["error"] and t["user_attrs"].get(SVG) == IMG for t in trials), trials
    engine = sa.create_engine(service.database_url)
    with engine.begin() as conn:
        for study_id, name in ((study, PAYLOAD_NAME), (failed, FAILED_NAME)):
            conn.execute(sa.text("UPDATE ft_studies SET name = :name WHERE id = :id"), {"name": name, "id": study_id})
        optuna_id = conn.execute(sa.text("SELECT optuna_study_id FROM ft_studies WHERE id = :id"), {"id": failed}).scalar_one()
        conn.execute(
            sa.text("INSERT INTO study_system_attributes (study_id, key, value_json) VALUES (:study, 'fusetune:warnings', :value)"),
            {"study": optuna_id, "value": json.dumps([WARNING])},
        )
    engine.dispose()
    assert client.study(study)["name"] == PAYLOAD_NAME
    return study, failed


#: Params named like members every JavaScript object inherits (``obj.constructor``, ...); the
#: width is fixed, so every trial completes and each slice has a point per trial.
MEMBER_NAMES_STUDY: dict[str, Any] = {
    "name": "object-member-params",
    "workload": "digits-mlp",
    "n_trials": 6,
    "epochs": 1,
    "max_array_size": 6,
    "sampler": {"name": "RandomSampler", "kwargs": {"seed": 1}},
    "search_space": {
        "hidden": D.distribution_to_json(D.CategoricalDistribution([32])),
        "__proto__": D.distribution_to_json(D.FloatDistribution(0.0, 1.0)),
        "constructor": D.distribution_to_json(D.IntDistribution(1, 3)),
        "toString": D.distribution_to_json(D.CategoricalDistribution(["a", "b"])),
        "hasOwnProperty": D.distribution_to_json(D.FloatDistribution(1e-3, 1.0, log=True)),
    },
}

#: What each slice chart plots: [[param, [x of each point]], ...] (ECharts' own option, as
#: drawn). Pairs, not an object: out["__proto__"] = ... would set the object's prototype.
SLICE_XS = """async () => {
  const echarts = await import("/dashboard/vendor/echarts-6.1.0/echarts.esm.min.js");
  return [...document.querySelectorAll("[data-chart-kind=slice]")].map((el) => {
    const chart = echarts.getInstanceByDom(el);
    return [el.dataset.chart.slice("slice-".length), chart ? chart.getOption().series[0].data.map((p) => p[0] ?? null) : null];
  });
}"""


#: The enumerable members a new object and a new array inherit: none, unless something of the
#: page wrote to Object.prototype (prototype pollution).
INHERITED = "() => { const found = []; for (const k in {}) found.push(k); for (const k in []) found.push(`[] ${k}`); return found; }"


def test_params_named_like_javascripts_own_members_show_as_any_other(service: Service, page: Any) -> None:
    """A param named ``__proto__``, ``constructor``, ``toString`` or ``hasOwnProperty`` has its
    slice, its parallel axis, its column and filter in the trials table, and its value in the
    drawer: never the member JavaScript objects inherit, never a prototype set, and drawn
    texts pollute no prototype (ECharts' text cache once took "__proto__" for its entry)."""
    study = service.finished(MEMBER_NAMES_STUDY)
    trials = sorted(service.client.trials(study), key=lambda t: t["number"])
    names = list(MEMBER_NAMES_STUDY["search_space"])
    assert {t["state"] for t in trials} == {"COMPLETE"}
    login(page, service, path=f"#/studies/{study}/params")

    page.wait_for_function(
        "(n) => document.querySelectorAll('[data-chart-kind=slice]').length === n", arg=len(names), timeout=LONG
    )
    page.wait_for_function("() => document.querySelector('[data-testid=param-trials-count]')?.textContent.endsWith('trials')")
    xs = dict(page.evaluate(SLICE_XS))
    assert set(xs) == set(names), xs
    for name in names:
        # The slice plots every trial at the value its params hold.
        categorical = name in ("hidden", "toString")  # a category axis: the choice as text
        expected = sorted(str(t["params"][name]) if categorical else t["params"][name] for t in trials)
        assert sorted(xs[name]) == expected, (name, xs[name])
    axes = page.evaluate("""async () => {
      const echarts = await import("/dashboard/vendor/echarts-6.1.0/echarts.esm.min.js");
      return echarts.getInstanceByDom(document.querySelector("[data-chart=parallel]")).getOption().parallelAxis.map((a) => a.name);
    }""")
    # Drawn with a zero-width space after "__proto__": the same on screen, another key to the
    # renderer's text cache (which "__proto__" would turn into Object.prototype).
    assert [a.replace("\u200b", "") for a in axes[: len(names)]] == names, axes

    page.click("[data-tab=trials]")
    page.wait_for_function("(n) => document.querySelectorAll('[data-table=trials] .row').length === n", arg=len(trials))
    header = page.eval_on_selector_all("[data-table=trials] .head button", "bs => bs.map(b => b.textContent)")
    assert all(name in header for name in names), header
    column = header.index("constructor")
    cells = page.eval_on_selector_all(
        "[data-table=trials] .row", "(rows, i) => rows.map((r) => [Number(r.dataset.number), r.children[i].textContent])", column
    )
    assert sorted(cells) == [[t["number"], str(t["params"]["constructor"])] for t in trials], cells
    # The filter reads the param, not Object.prototype.constructor.
    value = trials[0]["params"]["constructor"]
    chosen = sorted(t["number"] for t in trials if t["params"]["constructor"] == value)
    page.fill("[data-testid=trials-filter]", f"constructor={value}")
    page.wait_for_function(
        "(n) => document.querySelector('[data-testid=trials-count]').textContent.startsWith(`${n} of`)", arg=len(chosen)
    )
    assert sorted(visible_numbers(page, "trials")) == chosen
    assert foot(page, "trials") == (len(chosen), len(trials))

    page.fill("[data-testid=trials-filter]", "")
    page.locator("[data-table=trials] .row").first.click()
    drawer = page.locator("[data-testid=drawer]")
    drawer.locator("text=\"Params\"").wait_for()
    text = drawer.inner_text()
    assert all(name in text for name in names), text
    assert str(trials[0]["params"]["toString"]) in text
    # Every chart drew its texts, and no object of the page gained a member on the way.
    assert page.evaluate(INHERITED) == [], "an object of the page inherits enumerable members"


def test_the_page_and_the_api_send_a_strict_content_security_policy(service: Service) -> None:
    api = {"Authorization": f"Bearer {service.admin_token}"}
    for method, path, headers, status in [
        ("GET", "/", {}, 200),
        ("GET", "/dashboard/app.js", {}, 200),
        ("GET", "/dashboard/views/params.js", {}, 200),
        ("GET", "/dashboard/style.css", {}, 200),
        ("GET", "/dashboard/vendor/echarts-6.1.0/echarts.esm.min.js", {}, 200),
        ("GET", "/dashboard/vendor/uplot-1.6.32/uPlot.esm.js", {}, 200),
        ("GET", "/api/v1/studies", api, 200),
        ("GET", "/api/v1/studies/987654", api, 404),
        ("GET", "/api/v1/studies", {}, 401),
        ("POST", "/api/v1/studies", {**api, "Content-Type": "text/html"}, None),  # refused, by a middleware
    ]:
        r = httpx.request(method, f"{service.url}{path}", headers=headers, content=b"<p>" if method == "POST" else None)
        assert status is None or r.status_code == status, (path, r.status_code)
        policy = csp(r.headers)
        for directive, values in REQUIRED_CSP.items():
            assert policy.get(directive) == values, (path, directive, policy)
        assert r.headers.get("x-content-type-options") == "nosniff", path
        # Inline styles may be allowed (the chart libraries set style attributes); scripts never.
        assert not any("unsafe" in v for v in policy["script-src"] + policy["default-src"]), path


def test_hostile_strings_render_as_text_on_every_view(service: Service, page: Any) -> None:
    study, failed = payload_studies(service)
    trials = service.client.trials(study)
    failed_trials = service.client.trials(failed)
    params = list(SEARCH_SPACE)
    admin = {"Authorization": f"Bearer {service.admin_token}"}
    importances = httpx.get(
        f"{service.url}/api/v1/studies/{study}/importances", params={"evaluator": "fanova"}, headers=admin
    ).json()
    assert {IMG, SVG, RICH} <= set(importances["importances"]), importances

    page.add_init_script(WATCH)
    login(page, service, token=service.admin_token)
    tips: dict[str, dict[str, Any]] = {}

    def show_tips(where: str) -> None:
        """Every tooltip of the view, then: nothing ran, nothing was parsed into the page."""
        for chart, shown in page.evaluate(SHOW_EVERY_TIP).items():
            tips[f"{where}:{chart}"] = shown
        clean(where)

    def clean(where: str) -> None:
        report = page.evaluate("window.__xssReport()")
        assert report == {"pwned": 0, "by": [], "injected": [], "violations": []}, (where, report)

    # The studies page: both names, as text, in their links.
    for study_id, name in ((study, PAYLOAD_NAME), (failed, FAILED_NAME)):
        link = page.locator(f"tr[data-study-id='{study_id}'] td a")
        link.wait_for()
        assert link.text_content() == name

    # The payload study on every tab.
    page.evaluate("(h) => { location.hash = h; }", f"#/studies/{study}/progress")
    page.wait_for_function(DRAWN, arg=["history", "curves"], timeout=LONG)
    show_tips("progress")

    page.click("[data-tab=params]")
    slices = [f"slice-{p}" for p in params]
    page.wait_for_function(DRAWN, arg=["parallel", "importances", *slices], timeout=LONG)
    assert page.eval_on_selector_all("[data-chart-kind=slice]", "els => els.map(e => e.dataset.chart)") == slices
    show_tips("params")
    shown = " ".join(tips["params:importances"]["texts"])
    assert tips["params:importances"]["shown"] == len(importances["importances"])
    for name in importances["importances"]:
        assert name in shown, (name, shown)
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    for p in params:
        tip = tips[f"params:slice-{p}"]
        assert tip["shown"] == len(complete), (p, tip)
        assert all(p in text for text in tip["texts"]), (p, tip)
    choices_shown = " ".join(tips[f"params:slice-{SVG}"]["texts"])
    for t in complete:
        assert t["params"][SVG] in choices_shown, (t["params"][SVG], choices_shown)

    # The study's head: its name, as the page's title too, and its user attrs.
    assert page.text_content("[data-testid=study-name]") == PAYLOAD_NAME
    assert page.title() == f"fusetune · {PAYLOAD_NAME}"
    attrs = page.text_content("[data-testid=study-user-attrs]")
    for key, value in STUDY_ATTRS.items():
        shown_as = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))  # as JSON.stringify writes it
        assert key in attrs and shown_as in attrs, (key, shown_as, attrs)

    page.click("[data-tab=trials]")
    rows = page.locator("[data-table=trials] .row")
    page.wait_for_function("(n) => document.querySelectorAll('[data-table=trials] .row').length === n", arg=len(trials))
    header = page.text_content("[data-table=trials] .head")
    for p in params:
        assert p in header, (p, header)
    drawer = page.locator("[data-testid=drawer]")
    opened_errors = []
    for i in range(len(trials)):
        rows.nth(i).click()
        drawer.locator("text=\"Params\"").wait_for()  # exact: a trial's unused_params attr holds the word too
        number = int(rows.nth(i).get_attribute("data-number"))
        trial = next(t for t in trials if t["number"] == number)
        page.wait_for_function(
            "(n) => document.querySelector('[data-testid=drawer]')?.getAttribute('aria-label') === `Trial ${n}`", arg=number
        )
        text = drawer.text_content()
        for value in trial["params"].values():
            assert not isinstance(value, str) or value in text, (value, text)
        if trial["error"]:
            assert drawer.locator("[data-testid=trial-error]").text_content() == trial["error"]
            opened_errors.append(trial["error"])
        if trial["user_attrs"].get(SVG) == IMG:
            attrs = drawer.locator("[data-testid=trial-user-attrs]").text_content()
            for key, value in TRIAL_ATTRS.items():
                assert key in attrs and value in attrs, (key, value, attrs)
        page.keyboard.press("Escape")
        drawer.wait_for(state="detached")
    assert any(IMG in e for e in opened_errors), opened_errors
    clean("trials")

    page.click("[data-tab=arrays]")
    page.wait_for_selector("[data-testid=arrays] [data-array-id]")
    page.wait_for_function(DRAWN, arg=["timeline"], timeout=LONG)
    show_tips("arrays")
    assert tips["arrays:timeline"]["shown"] == len(service.client.arrays(study))
    assert tips["arrays:timeline"]["texts"], tips["arrays:timeline"]

    # The failed study: its name, its error, its trials' errors, on every tab.
    page.evaluate("(h) => { location.hash = h; }", f"#/studies/{failed}/progress")
    page.wait_for_selector(f"[data-study-id='{failed}'] [data-testid=study-error]")
    assert page.text_content("[data-testid=study-name]") == FAILED_NAME
    error = service.client.study(failed)["error"]
    assert SVG in error and page.text_content("[data-testid=study-error]") == error
    assert service.client.study(failed)["warnings"] == [WARNING]
    assert page.text_content("[data-testid=study-warnings] li") == WARNING
    page.wait_for_selector("[data-testid=stats]")
    show_tips("failed-progress")
    page.click("[data-tab=params]")
    page.wait_for_selector("[data-pane=params] [data-chart=parallel]")
    show_tips("failed-params")
    page.click("[data-tab=trials]")
    page.wait_for_function("(n) => document.querySelectorAll('[data-table=trials] .row').length === n", arg=len(failed_trials))
    for i in range(len(failed_trials)):
        rows.nth(i).click()
        drawer.locator("[data-testid=trial-error]").wait_for()
        assert SVG in drawer.locator("[data-testid=trial-error]").text_content()
        page.keyboard.press("Escape")
        drawer.wait_for(state="detached")
    page.click("[data-tab=arrays]")
    page.wait_for_selector("[data-testid=arrays] >> text=not been placed")
    clean("failed-trials")

    # The cluster, as the admin sees it.
    page.evaluate("(h) => { location.hash = h; }", "#/cluster")
    page.wait_for_selector("[data-testid=devices] tr[data-device]")
    page.wait_for_function(DRAWN, arg=["shares"], timeout=LONG)
    show_tips("cluster")
    assert tips["cluster:shares"]["shown"] > 0 and tips["cluster:shares"]["texts"]

    report = page.evaluate("window.__xssReport()")
    assert report == {"pwned": 0, "by": [], "injected": [], "violations": []}, report
    assert sum(t["shown"] for t in tips.values()) > 0

    # Beneath the text rendering, the policy: an inline handler put in the page is refused.
    directive = page.evaluate("""() => new Promise((resolve) => {
      document.addEventListener("securitypolicyviolation", (e) => resolve(e.effectiveDirective), { once: true });
      const probe = document.createElement("div");
      probe.innerHTML = `<img src="/no-such-image" onerror="__xss('probe')">`;
      document.body.append(probe);
    })""")
    assert directive.startswith("script-src"), directive
    assert page.evaluate("window.__pwned") == 0
