"""Prometheus metrics of one app (``GET /metrics``), through ``prometheus_client``.

Each app has a registry of its own (tests run several apps in one process). What the
database holds is read when Prometheus scrapes, so those series are exactly the database's:

* ``fusetune_trials{state}``: trials by state (``ft_trials``), every state, zeros included;
* ``fusetune_studies{state}``: studies by state;
* ``fusetune_arrays_running``: arrays training now (``ft_arrays`` RUNNING);
* ``fusetune_workers{state}`` (busy, idle), ``fusetune_worker_busy{worker, device_type}``
  (1 while it trains an array) and ``fusetune_worker_utilization_ratio`` (busy / all): this
  process's worker pool (none when the app runs without its scheduling loop);
* ``fusetune_epoch_reports_total``: array-epoch reports the scheduling loop has recorded
  since this process started (each is one ``ft_arrays.epochs_done`` step);
* ``fusetune_http_request_duration_seconds{method, route, status}``: a histogram of the
  time from a request's arrival to its response's last byte (an event stream's: its
  length). Its labels take known values only, so no request can add series at will
  (``/metrics`` is unauthenticated by default): ``method`` is one of :data:`METHODS`
  (``other`` for any other token a client sends), ``route`` the path template of the
  route the path matches, whatever the method (``unmatched`` for unknown paths), and
  ``status`` the status the app answered.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import func, select
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fusetune.server.db import Array, ArrayState, Study, StudyState, Trial, TrialState

#: The request methods that label requests as themselves (RFC 9110's and PATCH); any other
#: token a client sends is labelled ``other``.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})
#: The ``method`` label of a request whose method is not one of :data:`METHODS`.
OTHER_METHOD = "other"
#: The ``route`` label of a request whose path no route serves.
UNMATCHED = "unmatched"


class StateCollector:
    """The series read from the database and the scheduling loop at each scrape."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def describe(self) -> list[Metric]:
        return []  # no scrape at registration: the database may not be migrated yet

    def collect(self) -> Iterator[Metric]:
        state = self.app.state
        with state.sessions() as session:
            trials: dict[TrialState, int] = {s: n for s, n in session.execute(select(Trial.state, func.count()).group_by(Trial.state))}
            studies: dict[StudyState, int] = {s: n for s, n in session.execute(select(Study.state, func.count()).group_by(Study.state))}
            running = session.scalar(select(func.count()).select_from(Array).where(Array.state == ArrayState.RUNNING))
        family = GaugeMetricFamily("fusetune_trials", "Trials by state (ft_trials).", labels=["state"])
        for trial_state in TrialState:
            family.add_metric([trial_state.value], trials.get(trial_state, 0))
        yield family
        family = GaugeMetricFamily("fusetune_studies", "Studies by state (ft_studies).", labels=["state"])
        for study_state in StudyState:
            family.add_metric([study_state.value], studies.get(study_state, 0))
        yield family
        yield GaugeMetricFamily("fusetune_arrays_running", "Fused arrays training now (ft_arrays RUNNING).", value=running or 0)

        pool = getattr(state, "pool", None)
        workers = list(pool.workers) if pool is not None else []
        busy = [w for w in workers if not w.idle]
        family = GaugeMetricFamily("fusetune_workers", "Worker actors of this process's pool, busy or idle.", labels=["state"])
        family.add_metric(["busy"], len(busy))
        family.add_metric(["idle"], len(workers) - len(busy))
        yield family
        family = GaugeMetricFamily(
            "fusetune_worker_busy", "1 while the worker trains an array, else 0.", labels=["worker", "device_type"]
        )
        for w in workers:
            family.add_metric([w.name, w.device_type], 0 if w.idle else 1)
        yield family
        yield GaugeMetricFamily(
            "fusetune_worker_utilization_ratio", "Busy workers / all workers (0 with none).",
            value=len(busy) / len(workers) if workers else 0.0,
        )
        loop = getattr(state, "loop", None)
        yield CounterMetricFamily(
            "fusetune_epoch_reports", "Array-epoch reports recorded by the scheduling loop since the process started.",
            value=loop.reports_ingested if loop is not None else 0,
        )


class Metrics:
    """An app's registry: the request histogram and the :class:`StateCollector`."""

    def __init__(self, app: FastAPI) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Histogram(
            "fusetune_http_request_duration_seconds",
            "Time from a request's arrival to its response's last byte, by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf")),
        )
        self.registry.register(StateCollector(app))


class RequestMetrics:
    """ASGI middleware timing every HTTP request into ``Metrics.requests``."""

    def __init__(self, app: ASGIApp, fastapi: FastAPI) -> None:
        self.app = app
        self.fastapi = fastapi
        self._templates: list[tuple[re.Pattern[str], str]] | None = None

    def _route(self, path: str) -> str:
        """The template of the first route whose path matches (whatever its methods: a 405 on
        a known path is labelled with it), else :data:`UNMATCHED`."""
        if self._templates is None:  # every route exists by the first request
            from fusetune.server.api.errors import route_table

            self._templates = [(compile_path(p)[0], p) for p, _, _ in route_table(self.fastapi)]
        for pattern, template in self._templates:
            if pattern.match(path):
                return template
        return UNMATCHED

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: dict[str, Any] = {"code": 500, "observed": False}

        def observe() -> None:
            if not status["observed"]:
                status["observed"] = True
                metrics: Metrics = self.fastapi.state.metrics
                method = scope["method"] if scope["method"] in METHODS else OTHER_METHOD
                metrics.requests.labels(method, self._route(scope["path"]), str(status["code"])).observe(
                    time.perf_counter() - start
                )

        async def record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # Observed before the last byte goes out, so that a client that has read a
                # response always finds it counted by its next scrape; observing after
                # the app returned raced that scrape (a KeyError in CI).
                observe()
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            observe()  # a request that failed, or whose client left, before its last byte
