"""What ``benchmarks/api.py`` and ``benchmarks/dashboard.py`` share: big studies seeded in SQL,
the server that serves them, and the figures' small helpers.

Seeding goes around the service on purpose: 100,000 trials asked and reported through it
would take hours, and what is measured is reading them. The studies themselves are made by
the service (``service.create_study``), so their rows are what ``POST /studies`` makes.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

LR = '{"name": "FloatDistribution", "attributes": {"step": null, "low": 0.001, "high": 0.3, "log": true}}'
HIDDEN = '{"name": "CategoricalDistribution", "attributes": {"choices": [16, 32]}}'


def server_app() -> Any:
    """The uvicorn factory of the benchmarks' server: the real app, API only (no scheduling loop)."""
    from fusetune.server.app import create_app
    from fusetune.server.settings import get_settings

    return create_app(get_settings(), schedule=False)


@contextmanager
def scratch_database(base_url: str, prefix: str) -> Iterator[str]:
    """A new PostgreSQL database on ``base_url``'s server with fusetune's and Optuna's tables;
    yields its URL, and drops it at the end whatever happened."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from fusetune.server.db import get_engine, get_optuna_storage, get_read_engine, upgrade

    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(base_url).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        get_optuna_storage(url)
        yield url
    finally:
        get_engine(url).dispose()
        get_read_engine(url).dispose()
        get_optuna_storage.cache_clear()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def vacuum(url: str) -> None:
    """``VACUUM ANALYZE`` after seeding, so that plans see the seeded sizes."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("VACUUM ANALYZE"))
    engine.dispose()


@contextmanager
def api_server(url: str, workers: int, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """The real app, API only, in ``workers`` uvicorn processes sharing one loopback socket;
    yields its base URL once ``/healthz`` answers, and stops them at the end.

    The socket is made here, not by ``uvicorn --workers``: uvicorn's supervisor binds it with
    ``proto`` 0, so asyncio never sets TCP_NODELAY on the connections it accepts, and every
    keep-alive request after a connection's first waits ~40 ms for the client's delayed ACK
    (Kludex/uvicorn#3149, open). A socket made from its fd in each worker reads its real
    protocol back, and the accepted connections get TCP_NODELAY as with one worker.
    """
    import httpx

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(2048)
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    fd = listener.fileno()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"from benchmarks._bigstudy import _serve; _serve({fd})"], cwd=ROOT, pass_fds=(fd,),
            env={**os.environ, "FUSETUNE_DATABASE_URL": url, **(env or {})},
        )
        for _ in range(workers)
    ]
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        yield base
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:  # open event streams hold uvicorn's graceful stop
                proc.kill()
                proc.wait(timeout=15)
        listener.close()


def _serve(fd: int) -> None:
    """One worker process of :func:`api_server`: uvicorn serving the app on the inherited socket."""
    import uvicorn

    config = uvicorn.Config(
        server_app, factory=True, log_level="warning", access_log=False,
        # Longer than a poll interval: uvicorn's 5 s default closes idle connections just as
        # a poller reuses them (a "server disconnected" error that is no server's fault).
        timeout_keep_alive=75,
    )
    uvicorn.Server(config).run(sockets=[socket.socket(fileno=fd)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> str:
    """The CPU, its cores and the load when the run began: the line each table is recorded with."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{model}, {os.cpu_count()} cores, load average {load:.2f} at the start; Python {platform.python_version()}"


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (NaN of nothing)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))] if ordered else float("nan")


def create_studies(url: str, names: list[str], n_trials: int) -> dict[str, tuple[int, int]]:
    """Studies through the service (as POST /studies makes them): name -> (fusetune id, Optuna id)."""
    from fusetune.server import service
    from fusetune.server.db import Study, get_sessionmaker
    from fusetune.server.schemas import StudyCreate

    space = {"lr": json.loads(LR), "hidden": json.loads(HIDDEN)}
    out = {}
    with get_sessionmaker(url)() as session:
        for name in names:
            created = service.create_study(
                session, url,
                StudyCreate(workload="digits-mlp", n_trials=n_trials, epochs=100, name=name, search_space=space,
                            sampler={"name": "RandomSampler", "kwargs": {"seed": 0}}, fusion_sampler=False),
            )
            out[name] = (created.id, session.get(Study, created.id).optuna_study_id)
    return out


def seed_trials(conn: Any, study: tuple[int, int], n: int, steps: int, waiting: int, state_of_rest: str = "COMPLETE") -> None:
    """``n`` trials of a study in a few INSERT ... SELECTs (PostgreSQL): Optuna's trials, params
    (lr, hidden), values (of COMPLETE ones), ``steps`` intermediate values each, and fusetune's
    rows (revision 1). The last ``waiting`` are WAITING (RUNNING in Optuna, as the service asks
    them) and have no values yet; the others are ``state_of_rest`` (COMPLETE or RUNNING)."""
    from sqlalchemy import text

    ft_id, optuna_id = study
    p = {"sid": optuna_id, "ft": ft_id, "n": n, "w": n - waiting, "steps": steps, "lr": LR, "hidden": HIDDEN, "rest": state_of_rest}
    conn.execute(text(
        "INSERT INTO trials (number, study_id, state, datetime_start, datetime_complete) "
        "SELECT g, :sid, (CASE WHEN g >= :w OR :rest <> 'COMPLETE' THEN 'RUNNING' ELSE 'COMPLETE' END)::trialstate, "
        "now(), CASE WHEN g >= :w OR :rest <> 'COMPLETE' THEN NULL ELSE now() END FROM generate_series(0, :n - 1) g"), p)
    conn.execute(text(
        "INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json) "
        "SELECT trial_id, 'lr', 0.001 + (number % 997) / 997.0 * 0.29, :lr FROM trials WHERE study_id = :sid"), p)
    conn.execute(text(
        "INSERT INTO trial_params (trial_id, param_name, param_value, distribution_json) "
        "SELECT trial_id, 'hidden', number % 2, :hidden FROM trials WHERE study_id = :sid"), p)
    conn.execute(text(
        "INSERT INTO trial_values (trial_id, objective, value, value_type) "
        "SELECT trial_id, 0, round((0.5 + (hashtext(trial_id::text) & 1023) / 2048.0)::numeric, 4), 'FINITE' "
        "FROM trials WHERE study_id = :sid AND state = 'COMPLETE'"), p)
    if steps:
        conn.execute(text(
            "INSERT INTO trial_intermediate_values (trial_id, step, intermediate_value, intermediate_value_type) "
            "SELECT t.trial_id, s, 0.3 + 0.05 * s + (hashtext(t.trial_id::text || s::text) & 255) / 10000.0, 'FINITE' "
            "FROM trials t CROSS JOIN generate_series(0, :steps - 1) s WHERE t.study_id = :sid AND t.number < :w"), p)
    conn.execute(text(
        "INSERT INTO ft_trials (study_id, optuna_trial_id, number, params, signature, state, value, created_at, "
        "started_at, completed_at) "
        "SELECT :ft, t.trial_id, t.number, json_build_object('lr', lr.param_value, 'hidden', CASE WHEN h.param_value = 0 THEN 16 ELSE 32 END), "
        "'sig-' || (h.param_value::int)::text, CASE WHEN t.number >= :w THEN 'WAITING' ELSE :rest END, v.value, now(), "
        "CASE WHEN t.number >= :w THEN NULL ELSE now() END, t.datetime_complete "
        "FROM trials t JOIN trial_params lr ON lr.trial_id = t.trial_id AND lr.param_name = 'lr' "
        "JOIN trial_params h ON h.trial_id = t.trial_id AND h.param_name = 'hidden' "
        "LEFT JOIN trial_values v ON v.trial_id = t.trial_id AND v.objective = 0 WHERE t.study_id = :sid"), p)
    conn.execute(text(
        "INSERT INTO ft_trial_revisions (trial_id, study_id, revision) SELECT id, study_id, 1 FROM ft_trials WHERE study_id = :ft"), p)
