"""End-to-end sweep time: fusetune (fused, learning and unfused) against Ray Tune + OptunaSearch.

Runs the same sweeps, on the same machine, through four systems and prints what each
took, how good its best trial was and how busy the CPUs were:

- **fusetune**: ``fusetune serve`` is started as a subprocess on a free loopback port with
  a fresh database (a new SQLite file, or a new PostgreSQL database dropped afterwards),
  one untimed warm-up sweep (8 trials x 1 epoch) starts its Ray worker actors, and then
  every sweep is ``POST /api/v1/studies`` against the server already up: the wall time runs
  from just before the POST until the study's ``study.completed`` event arrives on its event
  stream (``GET /api/v1/studies/{id}/events``, woken by the server as it commits the event).
  The best value is the study's ``best_trial.value``; arrays and their ``timings`` (per-phase
  seconds, where the server reports them) come from ``GET /api/v1/arrays?study_id=``.
- **fusetune learning**: the same, with ``"max_concurrent_trials"`` half the sweep's trials in
  the POST (``--learning-in-flight``: another number): the sampler asks later trials as earlier
  ones finish, so TPE learns from them (the default asks every trial of these sweeps at once,
  to fill the arrays).
- **fusetune unfused**: the same, with ``"max_array_size": 1`` in the POST (the control).
- **raytune**: ``ray.tune.Tuner`` over a function trainable that trains the very same
  registered workload (model, search space, data, loss, metric, optimizer, batch size) one
  trial per process with ``torch.set_num_threads(1)``, searched by ``OptunaSearch`` with a
  seeded ``TPESampler`` and the workload's define-by-run space, ``max_concurrent_trials`` =
  cores, one CPU per trial, ``reuse_actors=True`` and otherwise Ray's defaults (its
  per-trial result loggers included). ``ray.init`` happens once, an untimed 8 x 1 warm-up
  fit runs first, and only ``tuner.fit()`` is timed. Its best value is the best over
  trials of each trial's *last* reported value (the metric after its final epoch, which
  is also what fusetune records as a trial's value).

CPU utilisation is system-wide, from /proc/stat between the start and the end of a timed
sweep: busy / total jiffies over all cores. Other load on the machine shows up in it. For a
user's workload's sweeps, CPU-s is the CPU time the sweep itself took: this process's and
every process's under it (the server, Ray's daemons and workers; Tune's trial actors), see
``CpuMeter``; where other jobs load the machine, the wall time holds waits for the CPUs and
the CPU-s do not.

fusetune's time outside training and evaluation is shown two ways: of wall x workers (every
worker-second that did not train or evaluate: idle workers included, such as the worker of
a sweep's cheaper class once its array is done), and on the critical path: the wall time
less the training and evaluation of the worker whose last array ended last, i.e. what the
user waited for beyond training (the asks and scheduling before its first array, builds,
reporting, final saves, the study's end and its event reaching the client).

Sweeps (``--sweeps``): mlp-64x10 and cnn-32x5 over every seed of ``--seeds``; mlp-256x10 and
mlp-512x10 with the first seed only, to show how the time grows with the number of trials.

**A user's own workload** (``--workload residual-cnn``: ``docs/examples/residual_cnn.py``'s
``WORKLOAD``, loaded by path, neither installed nor registered; sweep rcnn-32x5, or rcnn-8x2
with ``--quick``). fusetune's side is what the example program does:
``fusetune.client.create_study(workload=WORKLOAD, ..., sampler=TPESampler(seed=seed))`` with a
token of the ``default`` tenant (granted ``code_upload``); the client packages the workload
(cloudpickled by value, its search space stated as static distributions), uploads it and
creates the study, and the service's workers train it in the package's Ray ``runtime_env``.
The wall time runs from just before ``create_study`` until the study's ``study.completed``
event. Each timed sweep submits its code as new code (the workload's name made unique, so
a package of its own: packaged, uploaded, its describer and workers started in its env),
as a researcher who edited the file would; ``--reuse-package`` submits the same package as
the warm-up instead (it uploads nothing and the workers are already in its env). The
package upload and environment setup are a row of their own in the phase table: the
client's ``package()`` and upload (HEAD, then PUT) timed around the calls ``create_study``
makes, and, from the service's records (its events' timestamps and the arrays' timings),
the describer's env setup and package load (the study is not asked before it: study
created -> first ``trial.asked``) and the first array's worker's restart in the env (its
``array.started`` -> its first epoch's ``trial.reported``, less that epoch: the array's build
and probe from its ``timings``, and its training and evaluation taken as long as its second
epoch's; the other worker restarts meanwhile). Ray Tune's side trains the same object's
model, data (its ``Dataset`` through a ``DataLoader`` with the workload's batch size and
loader options, shuffled by a seeded generator, as a fusetune array reads it), loss,
objective metric over the whole validation set and optimizer, one trial per CPU as for
the digits, its define-by-run space in ``OptunaSearch`` with the same seeded TPE. Both
warm up with 8 trials x 1 epoch of the same workload. ``--workload resnet18``
(``benchmarks/_resnet18.py``: the same data and space at ResNet-18 size, sweep
resnet18-64x5) is ``benchmarks/gpu.sh``'s; ``--raytune-gpu F`` gives each Ray Tune trial
F of a GPU (fractional GPUs) and trains it there.

Usage: python benchmarks/e2e.py                                  # everything, SQLite and PostgreSQL
       python benchmarks/e2e.py --quick --backends sqlite        # mlp-64x10, one seed
       python benchmarks/e2e.py --systems raytune --sweeps mlp-64x10 --seeds 0
       python benchmarks/e2e.py --skip-raytune-scaling --json results.json
       python benchmarks/e2e.py --workload residual-cnn --systems fusetune,raytune   # rcnn-32x5, 3 seeds
       python benchmarks/e2e.py --workload resnet18 --backends sqlite --raytune-gpu 0.125  # on a GPU
       [--postgres-url URL] [--workers N] [--max-array-size B] [--sweep-timeout S] [--reuse-package]

``ray[tune]`` (the ``bench`` extra) is installed into this interpreter at start-up when
``import ray.tune`` fails. On PostgreSQL each run creates a database of its own next to
the one ``--postgres-url`` names, and drops it afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any
from unittest import mock

# Run as a script, this file's directory is sys.path[0] and benchmarks/fusion.py would
# shadow the fusion package (and Ray copies the driver's sys.path into its workers).
_HERE = pathlib.Path(__file__).resolve().parent
REPO = _HERE.parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SYSTEMS = ("fusetune", "learning", "unfused", "raytune")
SYSTEM_LABELS = {"fusetune": "fusetune", "learning": "fusetune learning", "unfused": "fusetune unfused",
                 "raytune": "Ray Tune + Optuna"}
#: The order timing keys are printed in; keys the server reports beyond these follow, sorted.
TIMING_ORDER = ("train_s", "eval_s", "report_s", "checkpoint_s", "sizing_s", "build_s", "wait_s", "idle_s")


@dataclass(frozen=True)
class Sweep:
    name: str
    workload: str
    n_trials: int
    epochs: int
    scaling: bool = False  # run with the first seed only; the Ray Tune runs of it can be skipped


#: Users' own workloads (``--workload``): a file and its ``Workload``, loaded by path and
#: uploaded as code packages; the other sweeps' workloads are the service's registered ones.
PACKAGES = {
    "residual-cnn": "docs/examples/residual_cnn.py:WORKLOAD",
    "resnet18": "benchmarks/_resnet18.py:WORKLOAD",
}

SWEEPS = {
    s.name: s
    for s in (
        Sweep("mlp-64x10", "digits-mlp", 64, 10),
        Sweep("cnn-32x5", "digits-cnn", 32, 5),
        Sweep("mlp-256x10", "digits-mlp", 256, 10, scaling=True),
        Sweep("mlp-512x10", "digits-mlp", 512, 10, scaling=True),
        Sweep("rcnn-32x5", "residual-cnn", 32, 5),
        Sweep("rcnn-8x2", "residual-cnn", 8, 2),
        Sweep("resnet18-64x5", "resnet18", 64, 5),
        Sweep("resnet18-8x2", "resnet18", 8, 2),
    )
}
#: ``--workload``: its sweeps by default, and with ``--quick`` (first seed only).
WORKLOAD_SWEEPS = {
    "digits": (["mlp-64x10", "cnn-32x5", "mlp-256x10", "mlp-512x10"], "mlp-64x10"),
    "residual-cnn": (["rcnn-32x5"], "rcnn-8x2"),
    "resnet18": (["resnet18-64x5"], "resnet18-8x2"),
}
WARMUP = Sweep("warmup-8x1", "digits-mlp", 8, 1)
#: Issue 31's target for a user's workload: this much faster than Ray Tune, at mean best values this close.
TARGET_SPEEDUP, TARGET_BEST = 2.5, 0.01


def is_package(sweep: Sweep) -> bool:
    """Whether the sweep's workload is a user's own, uploaded as a code package."""
    return sweep.workload in PACKAGES


def warmups(sweeps: list[Sweep]) -> list[Sweep]:
    """The untimed warm-ups the sweeps need: 8 trials x 1 epoch of each workload family
    (the digits share one; a user's workload warms its own package's env and imports)."""
    out = [WARMUP] if any(not is_package(s) for s in sweeps) else []
    for workload in dict.fromkeys(s.workload for s in sweeps if is_package(s)):
        out.append(Sweep(f"warmup-{workload}-8x1", workload, 8, 1))
    return out


def load_workload(key: str) -> Any:
    """The ``Workload`` of ``PACKAGES[key]``, its file imported by path (once per process) as
    ``fusetune_bench_<stem>``: neither installed nor on the path, as a user's script is.

    Ray Tune's trials call it too: a module-level function that keeps what it loaded in
    ``sys.modules``, so pickling it for Ray carries nothing already loaded.
    """
    where, attr = PACKAGES[key].split(":")
    path = REPO / where
    name = f"fusetune_bench_{path.stem}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return getattr(module, attr)


def workload_of(key: str) -> Any:
    """A sweep's workload object: a user's own (:func:`load_workload`) or a registered one."""
    if key in PACKAGES:
        return load_workload(key)
    from fusetune.workers.workloads import get_workload

    return get_workload(key)


@dataclass
class Run:
    """One timed sweep of one system."""

    system: str
    backend: str  # sqlite / postgres for fusetune, "-" for Ray Tune
    sweep: str
    seed: int
    wall_s: float
    best_value: float | None
    cpu_util: float
    n_arrays: int | None = None
    mean_array_size: float | None = None  # trials per array (an array of one may chain several)
    width: float | None = None  # members an array trained at once, on average over its epochs
    timings: dict[str, float] = field(default_factory=dict)  # summed over the study's arrays
    workers: int | None = None
    trial_counts: dict[str, int] = field(default_factory=dict)
    # Training and evaluation on the sweep's critical path: the worker whose last array ended
    # last (see critical_train_eval).
    critical_train_eval_s: float | None = None
    # A user's workload (code package): seconds of its packaging, upload and env setup
    # (see run_package_study); empty for the registered workloads and Ray Tune.
    setup: dict[str, float] = field(default_factory=dict)
    # CPU seconds the sweep took: this process and every process under it (the server, Ray's
    # daemons and workers, Tune's trial actors), see CpuMeter.
    cpu_s: float | None = None


# ----------------------------------------------------------------------------- set-up


def ensure_ray_tune() -> None:
    """Install the ``bench`` extra (ray[tune]) into this interpreter if ``ray.tune`` does not import."""
    try:
        import ray.tune  # noqa: F401
        import ray.tune.search.optuna  # noqa: F401
        return
    except ImportError as exc:
        print(f"ray.tune does not import ({exc}); installing the bench extra ...", flush=True)
    started = time.monotonic()
    # constraints.txt pins torch to the local CPU wheel; without it pip may pull a CUDA build.
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "--quiet", "-c", "constraints.txt", "-e", ".[bench]"], cwd=REPO
    )
    print(f"installed ray[tune] in {time.monotonic() - started:.0f} s; restarting", flush=True)
    # Start afresh rather than re-import: ray (with its C extension) is already half imported.
    os.execv(sys.executable, [sys.executable, str(pathlib.Path(__file__).resolve()), *sys.argv[1:]])


def machine() -> dict[str, Any]:
    """CPU model, cores, RAM and the versions that matter, for the header and the JSON."""
    cpuinfo = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown")
    mem_kb = 0
    with contextlib.suppress(OSError, StopIteration, ValueError):
        meminfo = pathlib.Path("/proc/meminfo").read_text().splitlines()
        mem_kb = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
    versions = {}
    for dist in ("torch", "ray", "optuna", "fastapi", "sqlalchemy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True)
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "python": platform.python_version(),
        "versions": versions,
        "commit": commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else ""),
    }


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all cores from /proc/stat's aggregate ``cpu`` line."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest and guest_nice are already in user/nice)
    total = sum(fields[:8])
    idle = fields[3] + fields[4]
    return total - idle, total


def utilisation(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Busy share (0-100 %) of all cores between two :func:`cpu_times` readings."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return 100.0 * busy / total if total > 0 else math.nan


def process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds: utime + stime) of every process /proc shows."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # after "pid (comm)": state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return out


class CpuMeter:
    """CPU seconds this process and all the processes under it use during a ``with`` block.

    Each process's utime + stime, sampled every ``interval`` seconds (what a process uses
    after its last sample, if it ends before the next, is lost: Tune's trial actors at a
    fit's end, a worker restarted in a package's env). Both systems' every process is under
    this one: the fusetune server (a child), its Ray daemons and workers; Ray Tune's driver
    (this process), its daemons and trial actors. On a machine that other jobs load too,
    this is the work a sweep took, where its wall time also holds its waits for the CPUs.
    Measured for a user's workload's sweeps only (``enabled``): a scan of /proc takes tens of
    milliseconds, which the digits sweeps' one-second critical paths would feel.
    """

    def __init__(self, enabled: bool = True, interval: float = 1.0) -> None:
        self.enabled, self.interval = enabled, interval
        self.base: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.seconds: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _mine() -> dict[int, float]:
        table = process_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        out, todo = {}, [os.getpid()]
        while todo:
            pid = todo.pop()
            if pid in table and pid not in out:
                out[pid] = table[pid][1]
                todo += children.get(pid, [])
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.last.update(self._mine())

    def __enter__(self) -> CpuMeter:
        if not self.enabled:
            return self
        self.base = self._mine()
        self.last = dict(self.base)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.enabled:
            return
        self._stop.set()
        self._thread.join()
        self.last.update(self._mine())
        self.seconds = sum(cpu - self.base.get(pid, 0.0) for pid, cpu in self.last.items())


def session_pids(sid: int) -> list[int]:
    """Processes of session ``sid`` (one this script created with ``start_new_session``)."""
    pids = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session
            if int(fields[3]) == sid and int(stat.parent.name) != os.getpid():
                pids.append(int(stat.parent.name))
    return pids


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def scratch_postgres(url: str) -> Iterator[str]:
    """A new, empty database on the server of ``url`` for one run, dropped afterwards.

    The benchmark never touches the database ``url`` names, which may hold someone's data.
    """
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    name = f"fusetune_bench_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


# ----------------------------------------------------------------------------- fusetune


class FusetuneServer:
    """``fusetune serve`` in a subprocess (its own session, so its Ray processes can be ended with it)."""

    def __init__(self, database_url: str, workdir: pathlib.Path, workers: int | None, max_array_size: int | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        # The benchmark acts as the service's admin (its studies go to the `default` tenant).
        admin_token = self.admin_token = secrets.token_urlsafe(32)
        env.update(
            FUSETUNE_ADMIN_TOKEN=admin_token,
            FUSETUNE_DATABASE_URL=database_url,
            FUSETUNE_HOST="127.0.0.1",
            FUSETUNE_PORT=str(self.port),
            FUSETUNE_ARTIFACT_DIR=str(workdir / "artifacts"),
        )
        if workers is not None:
            env["FUSETUNE_CPU_WORKERS"] = str(workers)
        if max_array_size is not None:
            env["FUSETUNE_MAX_ARRAY_SIZE"] = str(max_array_size)
        exe = pathlib.Path(sys.executable).with_name("fusetune")
        cmd = [str(exe), "serve"] if exe.exists() else [sys.executable, "-m", "fusetune.server.cli", "serve"]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.client = httpx.Client(
            base_url=self.url, timeout=60.0, headers={"Authorization": f"Bearer {admin_token}"}
        )

    def log_tail(self, lines: int = 40) -> str:
        """The end of the server's log without uvicorn's access lines."""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join([line for line in text if not line.startswith("INFO:     127.0.0.1:")][-lines:])

    def failed_steps(self) -> int:
        """How many scheduling rounds failed so far (the loop logs each and retries)."""
        return self.log_path.read_text(errors="replace").count("scheduling step failed")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"fusetune serve exited with {self.proc.returncode}; its log ends:\n{self.log_tail()}")

    def wait_healthy(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            with contextlib.suppress(httpx.TransportError):
                r = self.client.get("/healthz")
                if r.status_code == 200:
                    return r.json()
            if time.monotonic() > deadline:
                raise RuntimeError(f"fusetune serve did not answer /healthz in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM (uvicorn shuts the pool and Ray down), then SIGKILL whatever of its session is left."""
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Ray's raylet, GCS and workers stay in the server's session (its actors in process
        # groups of their own); end whatever of it is left behind.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            left = session_pids(self.proc.pid)
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            if left:
                time.sleep(3)
        self._log.close()


def run_study(server: FusetuneServer, sweep: Sweep, seed: int, label: str, args: argparse.Namespace,
              max_array_size: int | None = None, max_concurrent_trials: int | None = None) -> tuple[float, float, dict[str, Any]]:
    """Submit one sweep and wait for it: (wall seconds, CPU utilisation %, final study JSON).

    The end is the study's ``study.completed`` event, read from its event stream, which the
    server's scheduling loop wakes as it commits the event (the server's default poll interval
    only matters for other processes' events): polling ``GET /studies/{id}`` every 20 ms
    instead cost the server 20-40% of a core on 2 cores (authentication, the study's counts),
    and so did a stream polling the events table every 20 ms, taken from the workers being timed.
    The stream is narrowed to ``study.completed`` and ``array.ended`` (``?kind=``), as a client
    that waits for a study would: the rest of a sweep's ~1,400 events (every member's every
    epoch) would be encoded by the server and parsed here, on the cores the workers train on.
    ``array.ended`` keeps the stall timeout fed on long sweeps.

    Fails when the study is not COMPLETE after ``--sweep-timeout`` seconds, or when no event
    of it has come for ``--stall-timeout`` seconds (a server whose scheduling loop keeps
    failing never finishes).
    """
    body: dict[str, Any] = {
        "workload": sweep.workload,
        "n_trials": sweep.n_trials,
        "epochs": sweep.epochs,
        "sampler": {"name": "TPESampler", "kwargs": {"seed": seed}},
        "name": f"bench-{label}-{sweep.name}-s{seed}-{uuid.uuid4().hex[:6]}",
    }
    if max_array_size is not None:
        body["max_array_size"] = max_array_size
    if max_concurrent_trials is not None:
        body["max_concurrent_trials"] = max_concurrent_trials
    cpu0 = cpu_times()
    with CpuMeter(enabled=is_package(sweep)) as meter:
        start = time.perf_counter()
        r = server.client.post("/api/v1/studies", json=body)
        if r.status_code != 201:
            raise RuntimeError(f"POST /api/v1/studies answered {r.status_code}: {r.text}")
        study_id = r.json()["id"]
        wait_completed(server, study_id, body["name"], start, args)
        wall = time.perf_counter() - start
    cpu = utilisation(cpu0, cpu_times())
    study = server.client.get(f"/api/v1/studies/{study_id}").raise_for_status().json()
    return wall, cpu, {**study, "cpu_s": meter.seconds}


def wait_completed(server: FusetuneServer, study_id: int, name: str, start: float, args: argparse.Namespace) -> None:
    """Read the study's event stream until its ``study.completed`` (see :func:`run_study`)."""
    deadline = time.monotonic() + args.sweep_timeout
    moved, after, completed = time.monotonic(), 0, False
    while not completed:  # a stream ends after the server's FUSETUNE_EVENTS_MAX_STREAM_S: read on after it
        with server.client.stream(
            "GET", f"/api/v1/studies/{study_id}/events", params={"after": after, "kind": ["study.completed", "array.ended"]}
        ) as events:
            for line in events.iter_lines():
                now = time.monotonic()
                if line.startswith("id:"):
                    after, moved = int(line[3:]), now
                completed = line == "event: study.completed"
                if completed:
                    break
                if now > deadline or now - moved > args.stall_timeout:
                    why = "not COMPLETE after" if now > deadline else "no event for"
                    raise RuntimeError(f"study {study_id} ({name}): {why} {min(time.perf_counter() - start, now - moved):.0f} s; "
                                       f"the server's log ends:\n{server.log_tail()}")
        server.check_alive()


def tenant_token(server: FusetuneServer) -> str:
    """A token of the ``default`` tenant, which the admin lets upload code (``code_upload``),
    as ``make run`` does for its local tenant: what ``create_study`` of a user's workload takes."""
    from fusetune.client import Client

    with Client(server.url, token=server.admin_token) as admin:
        admin.set_code_upload("default", True)
        return str(admin.create_token("default", label="e2e benchmark")["token"])


class Stopwatch:
    """Seconds spent in functions swapped in for the run of a ``with``, by key, and what each returned last."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.returned: dict[str, Any] = {}

    def around(self, owner: Any, attr: str, key: str) -> contextlib.AbstractContextManager[Any]:
        original: Callable[..., Any] = getattr(owner, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            clock = time.perf_counter()
            try:
                self.returned[key] = original(*a, **kw)
                return self.returned[key]
            finally:
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - clock

        return mock.patch.object(owner, attr, timed)


def run_package_study(server: FusetuneServer, token: str, sweep: Sweep, seed: int, label: str, args: argparse.Namespace,
                      max_array_size: int | None = None, max_concurrent_trials: int | None = None,
                      fresh: bool = True) -> tuple[float, float, dict[str, Any], dict[str, float]]:
    """A user's own workload through ``fusetune.client.create_study``, as the example program
    submits it: (wall seconds, CPU utilisation %, final study JSON, the client's seconds).

    The wall time runs from just before ``create_study`` (it packages the workload, uploads the
    package unless the service has it, creates the study and loads it as an Optuna study)
    until the study's ``study.completed`` event (:func:`wait_completed`). ``fresh``: the
    workload under a name of its own, so its package is new to the service (uploaded, its
    env set up); else the same package every time. ``package_s`` and ``upload_s`` time the
    two calls ``create_study`` makes (``package()`` and ``Client.ensure_package``: a HEAD,
    and a PUT when the service lacks it), ``submit_s`` its POST, ``create_s`` all of it.
    """
    import optuna

    from fusetune.client import Client, _studies, create_study

    workload = workload_of(sweep.workload)
    if fresh:  # new code to the service: another name, another digest
        workload = dataclasses.replace(workload, name=f"{workload.name}-{label}-s{seed}-{uuid.uuid4().hex[:6]}")
    name = f"bench-{label}-{sweep.name}-s{seed}-{uuid.uuid4().hex[:6]}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    watch = Stopwatch()
    cpu0 = cpu_times()
    with CpuMeter() as meter:
        with watch.around(_studies, "package", "package_s"), watch.around(Client, "ensure_package", "upload_s"), \
                watch.around(Client, "submit", "submit_s"):
            start = time.perf_counter()
            create_study(
                workload=workload, n_trials=sweep.n_trials, epochs=sweep.epochs, study_name=name,
                direction=workload.direction, sampler=optuna.samplers.TPESampler(seed=seed),
                max_array_size=max_array_size, max_concurrent_trials=max_concurrent_trials, url=server.url, token=token,
            )
            created = time.perf_counter() - start
        study_id = int(watch.returned["submit_s"]["id"])
        wait_completed(server, study_id, name, start, args)
        wall = time.perf_counter() - start
    cpu = utilisation(cpu0, cpu_times())
    study = server.client.get(f"/api/v1/studies/{study_id}").raise_for_status().json()
    return wall, cpu, {**study, "cpu_s": meter.seconds}, {**watch.seconds, "create_s": created}


def study_events(server: FusetuneServer, study_id: int, kinds: list[str]) -> list[dict[str, Any]]:
    """The study's stored events of ``kinds`` (``follow=false``: the stream ends after them)."""
    response = server.client.get(f"/api/v1/studies/{study_id}/events",
                                 params={"after": 0, "follow": "false", "kind": kinds}).raise_for_status()
    return [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]


def package_setup(server: FusetuneServer, study: dict[str, Any], arrays: list[dict[str, Any]]) -> dict[str, float]:
    """The package's env setup, from the service's records (server timestamps and the arrays' timings).

    ``describer_s``: the study's ``created_at`` to its first ``trial.asked``: the service asks
    a study of a package only once the package's describer (an actor started in its runtime
    env) has loaded it, so this is its env setup and load, plus the first ask itself.
    ``worker_env_s``: the first array's ``array.started`` to its first epoch's reports, less
    that epoch: its build and probe (the array's ``timings``) and its training and evaluation,
    taken as long as its second epoch's (the time between its first and second epochs'
    reports; the average epoch of the array's ``timings`` if it trained one). What is left is
    the worker restarted in the package's env (Ray fetches and unpacks the package, starts the
    process, which imports torch and loads the workload) and the reports' way back. On a
    loaded machine two epochs differ by a second or more: it is an estimate, to that.
    """
    def at(stamp: str) -> float:
        return datetime.fromisoformat(stamp).timestamp()

    events = study_events(server, study["id"], ["trial.asked", "array.started", "trial.reported"])
    asked = [at(e["created_at"]) for e in events if e["kind"] == "trial.asked"]
    started = [e for e in events if e["kind"] == "array.started"]
    out: dict[str, float] = {}
    if asked:
        out["describer_s"] = min(asked) - at(study["created_at"])
    if started:
        first = min(started, key=lambda e: at(e["created_at"]))
        reports: dict[int, float] = {}
        for e in events:
            if e["kind"] == "trial.reported" and e["array_id"] == first["array_id"]:
                step = int(e["data"]["step"])
                reports[step] = min(reports.get(step, math.inf), at(e["created_at"]))
        array = next((a for a in arrays if a["id"] == first["array_id"]), None)
        if reports and array is not None:
            t = array.get("timings") or {}
            steps = sorted(reports)
            if len(steps) > 1:
                epoch = reports[steps[1]] - reports[steps[0]]
            else:
                epoch = (t.get("train_s", 0.0) + t.get("eval_s", 0.0)) / max(1, array["epochs_done"])
            once = sum(t.get(k, 0.0) for k in ("build_s", "probe_s", "sizing_s"))
            out["worker_env_s"] = max(0.0, reports[steps[0]] - at(first["created_at"]) - once - epoch)
    return out


def study_arrays(server: FusetuneServer, study_id: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The study's arrays once none is RUNNING (an array's record may close just after its last trial)."""
    deadline = time.monotonic() + timeout
    while True:
        arrays, url, params = [], "/api/v1/arrays", {"study_id": study_id, "limit": 1000}
        while url is not None:  # every page (the Link header's next)
            response = server.client.get(url, params=params).raise_for_status()
            arrays += response.json()
            url, params = response.links.get("next", {}).get("url"), None
        if all(a["state"] != "RUNNING" for a in arrays) or time.monotonic() > deadline:
            return arrays
        time.sleep(0.1)


def idle_worker_seconds(study: dict[str, Any], arrays: list[dict[str, Any]], workers: int) -> float:
    """Worker-seconds with no array, from the server's own timestamps: the study's span
    (created to completed) times the workers, less every array's span (created to completed).

    This is the time spent waiting for a decision: asking the first trials, scheduling
    rounds between arrays, workers left without work at the sweep's end.
    """
    def at(stamp: str) -> float:
        return datetime.fromisoformat(stamp).timestamp()

    span = at(study["completed_at"]) - at(study["created_at"])
    busy = sum(at(a["completed_at"]) - at(a["created_at"]) for a in arrays if a.get("completed_at"))
    return max(0.0, span * workers - busy)


def critical_train_eval(arrays: list[dict[str, Any]]) -> float | None:
    """Seconds of training and evaluation of the worker whose last array ended last.

    The sweep's wall time less these is what the user waits for beyond training on the
    sweep's critical path: the asks and scheduling before it starts, each array's build,
    reporting and final saves, the end of the study and its event reaching the client.
    (Workers idle because the other classes' arrays are shorter show in ``idle_s``.)
    """
    done = [a for a in arrays if a.get("completed_at") and a.get("worker")]
    if not done:
        return None
    last = max(done, key=lambda a: a["completed_at"])["worker"]
    return sum((a.get("timings") or {}).get("train_s", 0.0) + (a.get("timings") or {}).get("eval_s", 0.0)
               for a in done if a["worker"] == last)


def bench_fusetune(backend: str, database_url: str, sweeps: list[Sweep], seeds: list[int], systems: list[str],
                   args: argparse.Namespace) -> list[Run]:
    """Every (sweep, seed) through one server that stays up; fused and unfused runs interleaved."""
    runs: list[Run] = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"fusetune-e2e-{backend}-"))
        if backend == "postgres":
            database_url = stack.enter_context(scratch_postgres(database_url))
        server = FusetuneServer(database_url, pathlib.Path(tmp), args.workers, args.max_array_size)
        try:
            health = server.wait_healthy(args.startup_timeout)
            workers = int(health["workers"])
            token = tenant_token(server) if any(is_package(s) for s in sweeps) else ""
            print(f"\n[{backend}] fusetune serve at {server.url}: database {health['database']}, "
                  f"{workers} workers", flush=True)
            for warmup in warmups(sweeps):
                if is_package(warmup):
                    wall, *_ = run_package_study(server, token, warmup, 0, "warmup", args, fresh=not args.reuse_package)
                else:
                    wall, _, _ = run_study(server, warmup, 0, "warmup", args)
                print(f"[{backend}] warm-up sweep {warmup.name} took {wall:.1f} s (untimed)", flush=True)
            for sweep in sweeps:
                for seed in seeds_of(sweep, seeds):
                    for system in systems:
                        if system == "raytune":
                            continue
                        cap = 1 if system == "unfused" else None
                        concurrent = (args.learning_in_flight or sweep.n_trials // 2) if system == "learning" else None
                        failed_before = server.failed_steps()
                        setup: dict[str, float] = {}
                        if is_package(sweep):
                            wall, util, study, setup = run_package_study(server, token, sweep, seed, system, args, cap, concurrent,
                                                                         fresh=not args.reuse_package)
                        else:
                            wall, util, study = run_study(server, sweep, seed, system, args, cap, concurrent)
                        arrays = study_arrays(server, study["id"])
                        if is_package(sweep):
                            setup.update(package_setup(server, study, arrays))
                        timings: dict[str, float] = {}
                        for a in arrays:
                            for key, value in (a.get("timings") or {}).items():
                                if isinstance(value, int | float):
                                    timings[key] = timings.get(key, 0.0) + float(value)
                        timings["idle_s"] = idle_worker_seconds(study, arrays, workers)
                        best = study.get("best_trial") or {}
                        run = Run(
                            system=system, backend=backend, sweep=sweep.name, seed=seed, wall_s=wall,
                            best_value=best.get("value"), cpu_util=util, n_arrays=len(arrays),
                            mean_array_size=statistics.fmean(a["size"] for a in arrays) if arrays else None,
                            # member-epochs / array-epochs (these sweeps prune nothing: every
                            # trial trains sweep.epochs epochs)
                            width=(sum(a["size"] for a in arrays) * sweep.epochs / max(1, sum(a["epochs_done"] for a in arrays))
                                   if arrays else None),
                            timings=timings, workers=workers, trial_counts=study.get("trial_counts", {}),
                            critical_train_eval_s=critical_train_eval(arrays), setup=setup, cpu_s=study.get("cpu_s"),
                        )
                        runs.append(run)
                        print_progress(run)
                        failed = server.failed_steps() - failed_before
                        if failed:  # the loop went on, but a failed round delays what it would have started
                            print(f"  ! {failed} scheduling steps failed during this sweep; the server's log ends:\n"
                                  f"{server.log_tail(12)}", flush=True)
        finally:
            server.stop()
    return runs


# ----------------------------------------------------------------------------- Ray Tune


def raytune_trial(config: dict[str, Any], workload_name: str, epochs: int, seed: int) -> None:
    """One trial as a Ray Tune function trainable: the workload trained the way a user would write it.

    Same data, model, loss, metric, optimizer, batch size and per-epoch validation as a
    fusetune member; data are whole tensors indexed by a fresh permutation each epoch, as
    fusetune's workers do, so neither side pays a DataLoader.
    """
    import torch
    from ray import tune

    from fusetune.workers.optimization import resolve
    from fusetune.workers.workloads import get_workload

    torch.set_num_threads(1)
    workload = get_workload(workload_name)
    params = dict(config)
    # A seed per trial from the sweep seed and the trial's params: reproducible, distinct per trial.
    trial_seed = (seed * 1_000_003 + zlib.crc32(json.dumps(params, sort_keys=True).encode())) % 2**31
    torch.manual_seed(trial_seed)
    generator = torch.Generator().manual_seed(trial_seed)
    train, val = workload.datasets()
    x, y = train.tensors
    x_val, y_val = val.tensors
    model = workload.build_model(params)
    # The optimizer a fusetune member of these params trains with, as plain torch builds it.
    optimizer = resolve(workload, None, params).torch_optimizer(model.parameters())
    batch_size = workload.batch_size_for(params)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(y), generator=generator)
        for begin in range(0, len(y), batch_size):
            idx = order[begin : begin + batch_size]
            loss = workload.loss(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            value = float(workload.metric(model(x_val), y_val))
        tune.report({"value": value})


def raytune_package_trial(config: dict[str, Any], key: str, epochs: int, seed: int) -> None:
    """One trial of a user's own workload (``PACKAGES[key]``) as a Ray Tune function trainable,
    written as its user would write a training loop for it.

    The workload object's own pieces: ``build_model``, the optimizer a fusetune member of these
    params trains with (``resolve``: the workload's optimizer and defaults, the trial's params
    over them), ``forward``, ``target_of``, ``loss`` and the objective metric over the whole
    validation set. Its datasets are read through a ``DataLoader`` with the workload's batch
    size and loader options (``loader_options``, as a fusetune array builds its loader:
    ``pin_memory`` on CUDA), shuffled by a generator seeded per trial; the augmentation
    draws from torch's RNG, seeded per trial too. On the GPU Ray gives the trial (a fractional
    one with ``--raytune-gpu``) it trains there, under CUDA autocast with a gradient scaler
    when the workload asks for ``amp``, as fusetune's GPU workers do.
    """
    import ray
    import torch
    from ray import tune
    from torch.utils.data import DataLoader

    from fusetune.workers.data import loader_options, to_device
    from fusetune.workers.optimization import resolve

    torch.set_num_threads(1)
    workload = load_workload(key)
    if workload.lr_scheduler or workload.warmup_epochs or workload.max_norm:
        raise NotImplementedError(f"{key}: this trainable does not schedule the learning rate nor clip gradients")
    cuda = bool(ray.get_gpu_ids()) and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    params = dict(config)
    trial_seed = (seed * 1_000_003 + zlib.crc32(json.dumps(params, sort_keys=True).encode())) % 2**31
    torch.manual_seed(trial_seed)
    train, val = workload.datasets()
    options = loader_options(workload, None, device)
    shuffle = options.pop("shuffle", True)
    batch_size = workload.batch_size_for(params)
    train_loader = DataLoader(train, batch_size=batch_size, shuffle=shuffle,
                              generator=torch.Generator().manual_seed(trial_seed), **options)
    val_loader = DataLoader(val, batch_size=batch_size, shuffle=False, **{**options, "drop_last": False})
    model = workload.build_model(params).to(device)
    optimizer = resolve(workload, None, params).torch_optimizer(model.parameters())
    amp = bool(workload.amp and cuda)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)

    def autocast() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast("cuda", dtype=torch.float16) if amp else contextlib.nullcontext()

    metric = workload.metric_named(workload.metric_name)
    for _ in range(epochs):
        model.train()
        for batch in train_loader:
            batch = to_device(batch, device, non_blocking=cuda)
            with autocast():
                loss = workload.loss(workload.forward(model, batch), workload.target_of(batch))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        model.eval()
        outputs, targets, per_batch = [], [], []
        with torch.no_grad(), autocast():
            for batch in val_loader:
                batch = to_device(batch, device, non_blocking=cuda)
                output, target = workload.forward(model, batch), workload.target_of(batch)
                if metric.per_batch:  # a mean over samples: weighted by the batch's
                    per_batch.append((float(metric.fn(output, target)), len(target)))
                else:
                    outputs.append(output.float())
                    targets.append(target)
        if metric.per_batch:
            value = sum(v * n for v, n in per_batch) / sum(n for _, n in per_batch)
        else:
            value = float(metric.fn(torch.cat(outputs), torch.cat(targets)))
        tune.report({"value": value})


class WorkloadSpace:
    """The workload's define-by-run search space, as OptunaSearch's ``space``.

    A module-level class rather than a closure: Tune's experiment checkpoints pickle the
    searcher with plain ``pickle``. Returning None makes OptunaSearch build the config from
    what was suggested.
    """

    def __init__(self, workload_name: str) -> None:
        self.workload_name = workload_name

    def __call__(self, trial: Any) -> None:
        workload_of(self.workload_name).search_space(trial)
        return None


def make_trainable(workload_name: str, epochs: int, seed: int, gpu: float = 0.0) -> Any:
    """The trainable with the sweep's constants bound (OptunaSearch's config holds only the searched
    params): one CPU per trial, and ``gpu`` of a GPU (fractional GPUs) for a user's own workload."""
    from ray import tune

    if workload_name in PACKAGES:
        trainable = tune.with_parameters(raytune_package_trial, key=workload_name, epochs=epochs, seed=seed)
        return tune.with_resources(trainable, {"cpu": 1, "gpu": gpu} if gpu else {"cpu": 1})
    return tune.with_resources(
        tune.with_parameters(raytune_trial, workload_name=workload_name, epochs=epochs, seed=seed), {"cpu": 1}
    )


def run_raytune(sweep: Sweep, seed: int, storage: pathlib.Path, gpu: float = 0.0) -> tuple[float, float, float | None, int, float | None]:
    """One sweep through Ray Tune: (wall seconds of fit(), CPU utilisation %, best value, errored trials, CPU seconds)."""
    import optuna
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    workload = workload_of(sweep.workload)
    mode = "max" if workload.direction == "maximize" else "min"
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # "A new study created in memory" per fit
    search = OptunaSearch(space=WorkloadSpace(sweep.workload), metric="value", mode=mode,
                          sampler=optuna.samplers.TPESampler(seed=seed))
    tuner = tune.Tuner(
        make_trainable(sweep.workload, sweep.epochs, seed, gpu),
        tune_config=tune.TuneConfig(
            num_samples=sweep.n_trials,
            max_concurrent_trials=os.cpu_count(),
            search_alg=search,
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=f"{sweep.name}-s{seed}-{uuid.uuid4().hex[:6]}", storage_path=str(storage), verbose=0
        ),
    )
    cpu0 = cpu_times()
    with CpuMeter(enabled=is_package(sweep)) as meter:
        start = time.perf_counter()
        grid = tuner.fit()
        wall = time.perf_counter() - start
    util = utilisation(cpu0, cpu_times())
    values = [r.metrics["value"] for r in grid if r.error is None and r.metrics and "value" in r.metrics]
    pick = max if mode == "max" else min
    return wall, util, (pick(values) if values else None), grid.num_errors, meter.seconds


def bench_raytune(sweeps: list[Sweep], seeds: list[int], args: argparse.Namespace) -> list[Run]:
    import ray

    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="fusetune-e2e-raytune-") as tmp:
        ray.init(include_dashboard=False)
        try:
            resources = ray.cluster_resources()
            gpus = f" and {resources.get('GPU', 0):g} GPUs ({args.raytune_gpu:g} a trial)" if args.raytune_gpu else ""
            print(f"\n[raytune] Ray {ray.__version__} with {int(resources.get('CPU', 0))} CPUs{gpus}", flush=True)
            for warmup in warmups(sweeps):
                wall, *_ = run_raytune(warmup, 0, pathlib.Path(tmp), args.raytune_gpu)
                print(f"[raytune] warm-up fit {warmup.name} took {wall:.1f} s (untimed)", flush=True)
            for sweep in sweeps:
                if sweep.scaling and args.skip_raytune_scaling:
                    continue
                for seed in seeds_of(sweep, seeds):
                    wall, util, best, errors, cpu_s = run_raytune(sweep, seed, pathlib.Path(tmp), args.raytune_gpu)
                    run = Run(system="raytune", backend="-", sweep=sweep.name, seed=seed, wall_s=wall,
                              best_value=best, cpu_util=util, workers=os.cpu_count(),
                              trial_counts={"ERROR": errors} if errors else {}, cpu_s=cpu_s)
                    runs.append(run)
                    print_progress(run)
        finally:
            ray.shutdown()
    return runs


# ----------------------------------------------------------------------------- report


def seeds_of(sweep: Sweep, seeds: list[int]) -> list[int]:
    return seeds[:1] if sweep.scaling else seeds


def print_progress(run: Run) -> None:
    best = f"{run.best_value:.4f}" if run.best_value is not None else "-"
    arrays = (f", {run.n_arrays} arrays of {run.mean_array_size:.1f} trials, {run.width:.1f} at once"
              if run.n_arrays else "")
    bad = {k: v for k, v in run.trial_counts.items() if k in ("FAIL", "ERROR") and v}
    warn = f"  !! {bad}" if bad else ""
    work = f" ({run.cpu_s:.0f} CPU-s)" if run.cpu_s is not None else ""
    print(f"  {SYSTEM_LABELS[run.system]:<18} {run.backend:<8} {run.sweep:<11} seed {run.seed}: "
          f"{run.wall_s:7.1f} s{work}, best {best}, CPU {run.cpu_util:.0f}%{arrays}{warn}", flush=True)


def groups(runs: list[Run]) -> dict[tuple[str, str, str], list[Run]]:
    out: dict[tuple[str, str, str], list[Run]] = {}
    for r in runs:
        out.setdefault((r.system, r.backend, r.sweep), []).append(r)
    return out


def mean_wall(runs: list[Run]) -> float:
    return statistics.fmean(r.wall_s for r in runs)


def mean_best(runs: list[Run]) -> float | None:
    values = [r.best_value for r in runs if r.best_value is not None]
    return statistics.fmean(values) if values else None


def aggregate(key: tuple[str, str, str], runs: list[Run]) -> dict[str, Any]:
    walls = [r.wall_s for r in runs]
    bests = [r.best_value for r in runs if r.best_value is not None]
    timings: dict[str, float] = {}
    for r in runs:
        for k, v in r.timings.items():
            timings[k] = timings.get(k, 0.0) + v / len(runs)
    return {
        "system": key[0], "backend": key[1], "sweep": key[2], "seeds": [r.seed for r in runs],
        "wall_mean_s": statistics.fmean(walls), "wall_min_s": min(walls), "wall_max_s": max(walls),
        "best_mean": statistics.fmean(bests) if bests else None,
        "best_sd": statistics.stdev(bests) if len(bests) > 1 else 0.0 if bests else None,
        "best_min": min(bests) if bests else None, "best_max": max(bests) if bests else None,
        "arrays_mean": statistics.fmean(r.n_arrays for r in runs) if runs[0].n_arrays is not None else None,
        "array_size_mean": (statistics.fmean(r.mean_array_size for r in runs if r.mean_array_size is not None)
                            if any(r.mean_array_size is not None for r in runs) else None),
        "width_mean": (statistics.fmean(r.width for r in runs if r.width is not None)
                       if any(r.width is not None for r in runs) else None),
        "cpu_util_mean": statistics.fmean(r.cpu_util for r in runs),
        "cpu_s_mean": (statistics.fmean(r.cpu_s for r in runs if r.cpu_s is not None)
                       if any(r.cpu_s is not None for r in runs) else None),
        "timings_mean_s": timings,
        "workers": runs[0].workers,
        # mean over seeds of 1 - critical path's train+eval / wall
        "outside_critical": (statistics.fmean(1 - r.critical_train_eval_s / r.wall_s for r in runs)
                             if all(r.critical_train_eval_s is not None for r in runs) else None),
    }


def fmt(value: float | None, spec: str, none: str = "-") -> str:
    """``format(value, spec)``, or ``none`` for a missing value."""
    return none if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def print_tables(runs: list[Run], sweeps: list[Sweep], backends: list[str]) -> dict[str, Any]:
    """The per-(system, sweep) table, fusetune's time breakdown and the summary; returns them for the JSON."""
    order = {name: i for i, name in enumerate(s.name for s in sweeps)}
    rank = {b: i for i, b in enumerate([*backends, "-"])}
    grouped = sorted(groups(runs).items(),
                     key=lambda kv: (order[kv[0][2]], SYSTEMS.index(kv[0][0]), rank[kv[0][1]]))
    aggs = [aggregate(k, v) for k, v in grouped]

    print("\n== Sweeps (wall time from submission to COMPLETE; best = best trial's final validation metric; "
          "trials = per array, width = members an array trained at once)")
    header = (f"{'sweep':<11}{'system':<19}{'db':<9}{'seeds':>5}{'wall mean':>10}{'min-max':>16}"
              f"{'best mean':>10}{'sd':>8}{'min-max':>16}{'arrays':>7}{'trials':>7}{'width':>6}{'CPU':>6}{'CPU-s':>8}")
    print(header)
    print("-" * len(header))
    for a in aggs:
        wall_range = f"{a['wall_min_s']:.1f}-{a['wall_max_s']:.1f}"
        best_range = (f"{a['best_min']:.4f}-{a['best_max']:.4f}" if a["best_min"] is not None else "-")
        print(f"{a['sweep']:<11}{SYSTEM_LABELS[a['system']]:<19}{a['backend']:<9}{len(a['seeds']):>5}"
              f"{a['wall_mean_s']:>9.1f}s{wall_range:>16}{fmt(a['best_mean'], '.4f'):>10}"
              f"{fmt(a['best_sd'], '.4f'):>8}{best_range:>16}{fmt(a['arrays_mean'], '.1f'):>7}"
              f"{fmt(a['array_size_mean'], '.1f'):>7}{fmt(a['width_mean'], '.1f'):>6}{a['cpu_util_mean']:>5.0f}%"
              f"{fmt(a['cpu_s_mean'], '.0f'):>8}")

    fused = [a for a in aggs if a["system"] != "raytune"]
    if fused:
        keys = [k for k in TIMING_ORDER if any(k in a["timings_mean_s"] for a in fused)]
        keys += sorted({k for a in fused for k in a["timings_mean_s"]} - set(keys))
        print("\n== fusetune time breakdown: seconds summed over a study's arrays (mean over seeds), "
              "and % of wall x workers; outside train+eval: of wall x workers (idle workers included), "
              "and of the wall time on the critical path (the worker that finished last)")
        if not keys:
            print("(the server's arrays carry no `timings`: nothing to break down)")
        header = f"{'sweep':<11}{'system':<19}{'db':<9}{'workers':>8}" + "".join(f"{k:>18}" for k in keys) + \
            f"{'outside train+eval':>20}{'on critical path':>18}"
        print(header)
        print("-" * len(header))
        for a in fused:
            capacity = a["wall_mean_s"] * (a["workers"] or 1)
            t = a["timings_mean_s"]
            cells = "".join(
                f"{(f'{t[k]:.1f}s {100 * t[k] / capacity:4.0f}%' if k in t else '-'):>18}" for k in keys
            )
            outside = (f"{100 * (1 - (t['train_s'] + t.get('eval_s', 0.0)) / capacity):.0f}%"
                       if "train_s" in t else "n/a")
            a["outside_train_eval"] = (1 - (t["train_s"] + t.get("eval_s", 0.0)) / capacity) if "train_s" in t else None
            critical = fmt(None if a["outside_critical"] is None else 100 * a["outside_critical"], ".0f")
            print(f"{a['sweep']:<11}{SYSTEM_LABELS[a['system']]:<19}{a['backend']:<9}{a['workers'] or '-':>8}"
                  f"{cells}{outside:>20}{critical + '%':>18}")

    phases = print_phases(runs, sweeps, backends)

    by_key = {(a["system"], a["backend"], a["sweep"]): a for a in aggs}
    summary = []
    rt = {a["sweep"]: a for a in aggs if a["system"] == "raytune"}
    if fused:
        print("\n== Summary: speed-up = Ray Tune's mean wall time / the system's (higher: faster than Ray Tune); "
              "fusion gain = unfused / fused wall time; best = mean over seeds")
        header = (f"{'sweep':<11}{'db':<9}{'fused x':>9}{'learning x':>12}{'unfused x':>11}{'fusion gain':>13}"
                  f"{'|best fused - best RT|':>24}{'|best learning - best RT|':>27}{'|best unfused - best RT|':>26}")
        print(header)
        print("-" * len(header))
    for sweep in sweeps:
        for backend in backends:
            f = by_key.get(("fusetune", backend, sweep.name))
            lr = by_key.get(("learning", backend, sweep.name))
            u = by_key.get(("unfused", backend, sweep.name))
            r = rt.get(sweep.name)
            if not (f or lr or u):
                continue
            row = {
                "sweep": sweep.name, "backend": backend,
                "fused_speedup": r["wall_mean_s"] / f["wall_mean_s"] if f and r else None,
                "learning_speedup": r["wall_mean_s"] / lr["wall_mean_s"] if lr and r else None,
                "unfused_speedup": r["wall_mean_s"] / u["wall_mean_s"] if u and r else None,
                "fusion_gain": u["wall_mean_s"] / f["wall_mean_s"] if f and u else None,
                "best_diff_fused": (abs(f["best_mean"] - r["best_mean"])
                                    if f and r and None not in (f["best_mean"], r["best_mean"]) else None),
                "best_diff_learning": (abs(lr["best_mean"] - r["best_mean"])
                                       if lr and r and None not in (lr["best_mean"], r["best_mean"]) else None),
                "best_diff_unfused": (abs(u["best_mean"] - r["best_mean"])
                                      if u and r and None not in (u["best_mean"], r["best_mean"]) else None),
            }
            summary.append(row)
            print(f"{sweep.name:<11}{backend:<9}{times(row['fused_speedup']):>9}{times(row['learning_speedup']):>12}"
                  f"{times(row['unfused_speedup']):>11}{times(row['fusion_gain']):>13}"
                  f"{fmt(row['best_diff_fused'], '.4f'):>24}{fmt(row['best_diff_learning'], '.4f'):>27}"
                  f"{fmt(row['best_diff_unfused'], '.4f'):>26}")

    targets = [row for row in summary if is_package(SWEEPS[row["sweep"]]) and row["fused_speedup"] is not None]
    if targets:
        print(f"\n== A user's workload against the target: fusetune >= {TARGET_SPEEDUP:g}x faster than Ray Tune "
              f"at equal best value (means over seeds within {TARGET_BEST:g})")
    for row in targets:
        equal = row["best_diff_fused"] is not None and row["best_diff_fused"] <= TARGET_BEST
        row["target_met"] = bool(equal and row["fused_speedup"] >= TARGET_SPEEDUP)
        f, r = by_key.get(("fusetune", row["backend"], row["sweep"])), rt.get(row["sweep"])
        row["cpu_s_ratio"] = (r["cpu_s_mean"] / f["cpu_s_mean"]
                              if f and r and f.get("cpu_s_mean") and r.get("cpu_s_mean") else None)
        print(f"{row['sweep']:<14}{row['backend']:<9} speed-up {times(row['fused_speedup']):>7} "
              f"(Ray Tune's CPU-s / fusetune's: {times(row['cpu_s_ratio'])}), "
              f"|best fused - best RT| {fmt(row['best_diff_fused'], '.4f')}: "
              f"{'met' if row['target_met'] else 'NOT met'}")

    growth_sweeps = [s for s in sweeps if s.workload == "digits-mlp" and s.epochs == 10]
    growth = []
    if len(growth_sweeps) > 1:
        print("\n== Growth: mean wall seconds per trial, digits-mlp x 10 epochs")
        header = f"{'system':<19}{'db':<9}" + "".join(f"{s.n_trials:>10}" for s in growth_sweeps)
        print(header)
        print("-" * len(header))
        for system in SYSTEMS:
            for backend in (["-"] if system == "raytune" else backends):
                cells = [by_key.get((system, backend, s.name)) for s in growth_sweeps]
                if not any(cells):
                    continue
                per_trial = {s.n_trials: (c["wall_mean_s"] / s.n_trials if c else None)
                             for s, c in zip(growth_sweeps, cells, strict=True)}
                growth.append({"system": system, "backend": backend, "s_per_trial": per_trial})
                print(f"{SYSTEM_LABELS[system]:<19}{backend:<9}"
                      + "".join(f"{fmt(v, '.3f'):>10}" for v in per_trial.values()))
    return {"aggregates": aggs, "summary": summary, "growth": growth, "phases": phases}


#: The rows of a user's workload's phase table: (key, label); the first four add up to the
#: package upload and environment setup row.
SETUP_PHASES = (
    ("package_s", "client: package() (cloudpickle, static space)"),
    ("upload_s", "client: upload (HEAD, PUT)"),
    ("describer_s", "service: describer env + load, first ask"),
    ("worker_env_s", "service: first array's worker restart (est.)"),
)


def _setup_s(r: Run) -> float | None:
    """A run's package upload and environment setup: the sum of its SETUP_PHASES."""
    return sum(r.setup.get(k, 0.0) for k, _ in SETUP_PHASES) if r.setup else None


def _rest_s(r: Run) -> float | None:
    """A run's wall time outside its setup and the train + eval of the worker that ended last."""
    s, c = _setup_s(r), r.critical_train_eval_s
    return None if s is None or c is None else r.wall_s - s - c


def _mean_of(runs: list[Run], value: Callable[[Run], float | None]) -> float | None:
    got = [v for v in map(value, runs) if v is not None]
    return statistics.fmean(got) if got else None


def print_phases(runs: list[Run], sweeps: list[Sweep], backends: list[str]) -> list[dict[str, Any]]:
    """For the sweeps of a user's workload: the wall time phase by phase (mean over seeds),
    the package upload and environment setup as a row of its own."""
    out: list[dict[str, Any]] = []
    order = {b: i for i, b in enumerate(backends)}
    systems = [s for s in SYSTEMS if s != "raytune"]
    phases: list[tuple[str, Callable[[Run], float | None]]] = [("package upload + environment setup", _setup_s)]
    phases += [(f"  {label}", lambda r, key=key: r.setup.get(key)) for key, label in SETUP_PHASES]
    phases += [("train + eval (the worker that ended last)", lambda r: r.critical_train_eval_s),
               ("everything else (its restart, probe, reports, ...)", _rest_s),
               ("wall", lambda r: r.wall_s)]
    for sweep in sweeps:
        if not is_package(sweep):
            continue
        mine = sorted(((k, v) for k, v in groups(runs).items() if k[2] == sweep.name and k[0] != "raytune"),
                      key=lambda kv: (systems.index(kv[0][0]), order.get(kv[0][1], 99)))
        if not mine:
            continue
        print(f"\n== {sweep.name}, a user's workload uploaded by create_study: where the wall time goes "
              "(seconds, mean over seeds, and % of the wall)")
        columns = [f"{SYSTEM_LABELS[k[0]]} {k[1]}" for k, _ in mine]
        wide = max(26, *(len(c) + 2 for c in columns))
        header = f"{'phase':<50}" + "".join(f"{c:>{wide}}" for c in columns)
        print(header)
        print("-" * len(header))
        rows = []
        for label, value in phases:
            cells = [_mean_of(rs, value) for _, rs in mine]
            rows.append({"phase": label.strip(), "mean_s": cells})
            text = "".join(f"{(f'{m:.2f}s {100 * m / mean_wall(rs):5.1f}%' if m is not None else '-'):>{wide}}"
                           for m, (_, rs) in zip(cells, mine))
            print(f"{label:<50}{text}")
        out.append({"sweep": sweep.name, "columns": columns, "rows": rows})
    return out


# ----------------------------------------------------------------------------- main


def print_saved(paths: list[str], out: pathlib.Path | None) -> None:
    """The tables of the runs saved by earlier invocations' ``--json``, merged."""
    saved = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    runs = [Run(**r) for s in saved for r in s["runs"]]
    names = list(dict.fromkeys(r.sweep for r in runs))
    backends = list(dict.fromkeys(r.backend for r in runs if r.backend != "-"))
    machines = []
    for s, path in zip(saved, paths):
        for m in s.get("machines") or [s["machine"]]:  # a merged file holds its sources' machines
            machines.append(m)
            print(f"{path}: {m['cpu_model']}, {m['cores']} cores; fusetune {m['commit']}")
        print(f"{path}: {len(s['runs'])} runs")
    tables = print_tables(runs, [SWEEPS[n] for n in names], backends)
    if out:
        out.write_text(json.dumps({"machines": machines, "sources": paths,
                                   "runs": [asdict(r) for r in runs], **tables}, indent=2))
        print(f"\nwrote {out}")


def _terminate_on_sigterm(signum: int, frame: Any) -> None:
    # Turn SIGTERM into SystemExit so the finally blocks stop the server and remove temp dirs.
    raise SystemExit(128 + signum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(WORKLOAD_SWEEPS), default="digits",
                        help="whose sweeps (unless --sweeps names them): the registered digits workloads, or a "
                             "user's own uploaded by create_study (residual-cnn: docs/examples/residual_cnn.py; "
                             "resnet18: benchmarks/_resnet18.py)")
    parser.add_argument("--sweeps", default=None,
                        help=f"comma-separated, of: {', '.join(SWEEPS)} (default: --workload's)")
    parser.add_argument("--seeds", default="0,1,2", help="TPE seeds (scaling sweeps use the first only)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    parser.add_argument("--backends", default="sqlite,postgres", help="fusetune's databases: sqlite, postgres")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL,
                        help="PostgreSQL server (a database of the run's own is created there and dropped)")
    parser.add_argument("--workers", type=int, default=None,
                        help="FUSETUNE_CPU_WORKERS (default: the server's, one per core)")
    parser.add_argument("--max-array-size", type=int, default=None,
                        help="FUSETUNE_MAX_ARRAY_SIZE for the server (default: the server's)")
    parser.add_argument("--learning-in-flight", type=int, default=None,
                        help="fusetune learning's max_concurrent_trials (default: half the sweep's trials)")
    parser.add_argument("--skip-raytune-scaling", action="store_true",
                        help="do not run Ray Tune on mlp-256x10 and mlp-512x10")
    parser.add_argument("--quick", action="store_true",
                        help="the first seed only, of mlp-64x10 (rcnn-8x2, resnet18-8x2 for --workload's)")
    parser.add_argument("--reuse-package", action="store_true",
                        help="a user's workload: every sweep submits the warm-up's package (uploaded, its env set up "
                             "once) instead of new code each time")
    parser.add_argument("--raytune-gpu", type=float, default=0.0,
                        help="a user's workload: the fraction of a GPU each Ray Tune trial gets (and trains on); "
                             "0: CPUs only")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--sweep-timeout", type=float, default=3600.0, help="seconds one fusetune sweep may take")
    parser.add_argument("--stall-timeout", type=float, default=300.0,
                        help="give up on a fusetune sweep whose trial counts have not changed for this long")
    parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the results here")
    parser.add_argument("--tables-from", default=None, metavar="JSON[,JSON...]",
                        help="run nothing: print the tables of the runs in these --json files together "
                             "(e.g. one invocation per seed, so that the systems take turns on a shared machine)")
    args = parser.parse_args()
    if args.tables_from:
        print_saved(args.tables_from.split(","), args.json)
        return

    seeds = [int(s) for s in args.seeds.split(",")]
    defaults, quick = WORKLOAD_SWEEPS[args.workload]
    names = args.sweeps.split(",") if args.sweeps else defaults
    if args.quick:
        seeds, names = seeds[:1], [quick]
    unknown = [n for n in names if n not in SWEEPS]
    systems = args.systems.split(",")
    backends = args.backends.split(",") if any(s != "raytune" for s in systems) else []
    if unknown or set(systems) - set(SYSTEMS) or set(backends) - {"sqlite", "postgres"}:
        parser.error(f"unknown sweep, system or backend in {names}, {systems}, {backends}")
    sweeps = [SWEEPS[n] for n in names]

    signal.signal(signal.SIGTERM, _terminate_on_sigterm)
    if "raytune" in systems:
        ensure_ray_tune()
    info = machine()
    v = info["versions"]
    print(f"machine: {info['cpu_model']}, {info['cores']} cores, {info['ram_gib']} GiB RAM; Python {info['python']}, "
          f"torch {v['torch']}, ray {v['ray']}, optuna {v['optuna']}; fusetune {info['commit']}")
    print(f"sweeps: {', '.join(names)}; seeds {seeds}; systems {', '.join(systems)}; fusetune databases "
          f"{', '.join(backends) or '-'}; {args.workers} fusetune CPU workers, Ray Tune {os.cpu_count()} "
          f"concurrent trials" + (f" ({args.raytune_gpu:g} GPU each)" if args.raytune_gpu else ""))

    runs: list[Run] = []
    for backend in backends:
        if backend == "sqlite":
            with tempfile.TemporaryDirectory(prefix="fusetune-e2e-db-") as db:
                runs += bench_fusetune(backend, f"sqlite:///{db}/fusetune.db", sweeps, seeds, systems, args)
        else:
            runs += bench_fusetune(backend, args.postgres_url, sweeps, seeds, systems, args)
    if "raytune" in systems:
        runs += bench_raytune(sweeps, seeds, args)

    tables = print_tables(runs, sweeps, backends)
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": [asdict(r) for r in runs], **tables}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
