"""What the fault tests share: measuring what a fault cost, the service as a process of its
own, a TCP proxy that cuts the database, and the fault matrix the tests write.

Each fault test writes its row of the fault matrix to ``build/reliability/<fault>.json``
(``FUSETUNE_RELIABILITY_DIR`` overrides the folder); ``benchmarks/reliability_table.py``
turns those files into the table of ``docs/reliability.md``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import optuna
import sqlalchemy as sa

from tests.conftest import free_port, running_service

ROOT = Path(__file__).resolve().parents[1]
#: The longest a fault test waits for an event: a guard against hanging, not a guess at how long
#: anything takes (a loaded 2-core box trained the digits MLP at seconds an epoch).
GUARD_S = 900.0
RESULTS = Path(os.environ.get("FUSETUNE_RELIABILITY_DIR", ROOT / "build" / "reliability"))


# -- the in-process faults' service --------------------------------------------------------------
@contextmanager
def faults_service(ray_cluster: str, root: Path, **settings: Any) -> Iterator[tuple[Any, str, Path]]:
    """A live service on SQLite under ``root`` with one CPU worker (arrays of up to four), that
    checkpoints every epoch, pings its busy worker every 0.5 s and replaces one silent for 5 s,
    and resolves workloads by import path; ``settings`` change it. Yields (client, database
    URL, artifact folder)."""
    url = f"sqlite:///{root / 'fusetune.db'}"
    with running_service(
        ray_cluster, url, cpu_workers=1, max_array_size=4, artifact_dir=root / "artifacts", checkpoint_interval_s=0,
        heartbeat_interval_s=0.5, heartbeat_timeout_s=5, allow_workload_imports=True, **settings,
    ) as client:
        yield client, url, root / "artifacts"


# -- what a fault cost ---------------------------------------------------------------------------
def audit(url: str, study_name: str, epochs: int) -> dict[str, Any]:
    """Every trial of the study has ended, and what its stored curve lacks or repeats.

    ``points_lost``: epochs a trial trained (a completed trial: all ``epochs``; a pruned or
    failed one: up to its last stored step) with no stored value. ``points_duplicated``:
    (trial, step) pairs stored more than once. ``trials_failed``: trials that ended FAIL.
    ``epochs_retrained``: epochs trained again
    after resuming from a checkpoint (the trials' ``epochs_retrained`` user attrs).
    """
    study = optuna.load_study(study_name=study_name, storage=url)
    lost, retrained, unfinished = 0, 0, []
    resumed: dict[int, list[int]] = {}
    for trial in study.trials:
        if not trial.state.is_finished():
            unfinished.append(trial.number)
        steps = set(trial.intermediate_values)
        if trial.state == optuna.trial.TrialState.COMPLETE:
            expected = set(range(epochs))
        else:
            expected = set(range(max(steps) + 1)) if steps else set()
        lost += len(expected - steps)
        retrained += int(trial.user_attrs.get("epochs_retrained", 0))
        if trial.user_attrs.get("resumed_at_epochs"):
            resumed[trial.number] = list(trial.user_attrs["resumed_at_epochs"])
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            duplicated = conn.execute(
                sa.text(
                    "SELECT COALESCE(SUM(n - 1), 0) FROM (SELECT v.trial_id, v.step, COUNT(*) AS n"
                    " FROM trial_intermediate_values v JOIN trials t ON t.trial_id = v.trial_id"
                    " JOIN studies s ON s.study_id = t.study_id WHERE s.study_name = :name"
                    " GROUP BY v.trial_id, v.step) AS counts"
                ),
                {"name": study_name},
            ).scalar_one()
    finally:
        engine.dispose()
    return {
        "trials": len(study.trials),
        "states": sorted({t.state.name for t in study.trials}),
        "trials_failed": sum(t.state == optuna.trial.TrialState.FAIL for t in study.trials),
        "unfinished": unfinished,
        "points_lost": lost,
        "points_duplicated": int(duplicated),
        "epochs_retrained": retrained,
        "resumed_at_epochs": resumed,
    }


def record(fault: str, **row: Any) -> None:
    """Write the fault's row of the matrix (see the module docstring)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in fault.lower()).strip("-")
    (RESULTS / f"{slug}.json").write_text(json.dumps({"fault": fault, **row}, indent=1, sort_keys=True))


def wait_until(
    done: Callable[[], Any], what: str, timeout: float = GUARD_S, poll: float = 0.1, explain: Callable[[], str] | None = None
) -> Any:
    """Poll ``done`` until it returns something true; that is returned. On a timeout the failure
    ends with what ``explain`` says (a service's log, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}" + (f"\n{explain()}" if explain else ""))
        time.sleep(poll)


def reported_steps(url: str, study_name: str) -> dict[int, int]:
    """Each trial's number of stored intermediate values, read from the database itself."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT t.number, COUNT(v.step) FROM trials t JOIN studies s ON s.study_id = t.study_id"
                    " LEFT JOIN trial_intermediate_values v ON v.trial_id = t.trial_id"
                    " WHERE s.study_name = :name GROUP BY t.number"
                ),
                {"name": study_name},
            ).all()
    finally:
        engine.dispose()
    return {number: count for number, count in rows}


def resumed(client: Any, study_id: int, numbers: set[int], count: int = 1) -> bool:
    """Whether each trial ``numbers`` has reported from ``count`` resumes (its first epoch each time)."""
    by_number = {t["number"]: t for t in client.trials(study_id)}
    return all(len(by_number[n]["user_attrs"].get("resumed_at_epochs", [])) >= count for n in numbers)


# -- processes -----------------------------------------------------------------------------------
def processes_under(marker: str) -> list[int]:
    """Pids of this machine's processes whose command line names ``marker`` (a temp dir of ours)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def short_tmpdir(prefix: str) -> str:
    """A temp dir with a short path: Ray's sockets live under it (Unix socket paths are short)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


class ServiceProcess:
    """``fusetune serve`` in a process (and session) of its own, with its own local Ray or a
    cluster's address; :meth:`kill9` kills the whole of it at once, as a crash would."""

    def __init__(self, env: dict[str, str], log_path: Path, admin_token: str) -> None:
        self.ray_tmp = short_tmpdir("ft12srv-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # fusetune and ray, as installed
        self.env = {**os.environ, **env, "RAY_TMPDIR": self.ray_tmp, "FUSETUNE_ADMIN_TOKEN": admin_token, "PATH": path}
        self.admin_token = admin_token
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, command: list[str] | None = None) -> ServiceProcess:
        command = command or [sys.executable, "-m", "fusetune.server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(command, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def healthy(self, timeout: float = 180.0, workers: bool = True) -> dict[str, Any]:
        """Wait until the API answers (and, with ``workers``, this server schedules on some)."""

        def check() -> dict[str, Any] | None:
            assert self.proc is not None and self.proc.poll() is None, f"the service exited; see {self.log_path}"
            try:
                health = httpx.get(f"{self.url}/healthz", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                return None
            return health if (health.get("workers", 0) > 0 or not workers) else None

        return wait_until(check, f"the service at {self.url}", timeout=timeout, poll=0.3)

    def log_tail(self, lines: int = 80) -> str:
        """The end of the service's log, for a failure message."""
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return f"the end of {self.log_path}:\n" + "\n".join(text[-lines:])

    def token(self) -> str:
        from fusetune.client import Client

        with Client(self.url, token=self.admin_token) as admin:
            return admin.create_token("default", label="fault tests")["token"]

    def kill9(self) -> None:
        """SIGKILL the server's whole session and anything else its Ray started (by its temp dir)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        kill_all(processes_under(self.ray_tmp))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill9()


# -- the database, cut -----------------------------------------------------------------------------
class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target``; :meth:`cut` closes every connection and stops
    listening (new ones are refused), :meth:`restore` listens again on the same port."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._thread.start()
        self.restore()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def restore(self) -> None:
        async def listen() -> None:
            self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port, reuse_address=True)

        self._run(listen())

    def cut(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()

        self._run(close())

    def close(self) -> None:
        self.cut()

        async def cancel() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        self._run(cancel())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()
                self._writers.discard(dst)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@contextmanager
def proxied(url: str) -> Iterator[tuple[str, TcpProxy]]:
    """``url`` (PostgreSQL) through a :class:`TcpProxy`; yields the proxied URL and the proxy."""
    parsed = sa.engine.make_url(url)
    proxy = TcpProxy(parsed.host or "127.0.0.1", parsed.port or 5432)
    try:
        yield parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False), proxy
    finally:
        proxy.close()
