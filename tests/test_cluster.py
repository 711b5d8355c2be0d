"""A real Ray cluster on loopback, started by docker-compose.yml's own commands.

The Ray head (``ray-head``), a second node (``gpu-worker``; here its CPU) and the server
(``server``: its CPU-less Ray node, then ``fusetune serve``) run the commands their
containers run, read from docker-compose.yml; the test only adds what one host needs to run
several nodes at once: each node's temp dir, CPU count and ports, and the addresses of
loopback for the containers' host names. Arrays run on both nodes; the pool follows the
second node as it joins and when its raylet is killed mid-array, and that node's members
resume on the head from the shared artifact store. A tenant's uploaded workload, from a module
no node or service has, trains on both nodes: each node's Ray runtime-env agent fetched its
package from the cluster's GCS and unpacked it under that node's own temp dir.
"""

from __future__ import annotations

import importlib
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import optuna
import pytest
import sqlalchemy as sa
import yaml

from tests.conftest import free_port
from tests.faults import ROOT, ServiceProcess, audit, kill_all, processes_under, record, resumed, short_tmpdir, wait_until

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {
    "hidden": D.distribution_to_json(D.CategoricalDistribution([32])),
    "lr": D.distribution_to_json(D.FloatDistribution(0.01, 0.1)),
}


def compose_services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def node_flags(temp_dir: str, cpus: int) -> str:
    """What one host needs to run one more Ray node: loopback, its own temp dir, CPUs and ports."""
    ports = " ".join(
        f"--{flag}={free_port()}"
        for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")
    )
    return f"--node-ip-address=127.0.0.1 --temp-dir={temp_dir} --num-cpus={cpus} --num-gpus=0 {ports}"


def on_loopback(command: str, head_port: int) -> str:
    return command.replace("ray-head:6379", f"127.0.0.1:{head_port}")


#: The containers hold no Ray auth token (~/.ray/auth_token), so their cluster runs without
#: one; this host may have one, which would turn it on for the head alone.
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


def start(command: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # ray and fusetune, as in the image
    return subprocess.Popen(
        shlex.split(command), env={**os.environ, **RAY_ENV, **env, "PATH": path}, cwd=ROOT,
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )


#: ``ray start`` gives a new node's raylet a hard-coded 30 s to register with the GCS. On two
#: cores, with another test's cluster starting beside this one, it can miss that, and the
#: node fails with this line: the one failure that :func:`start_node` starts again.
RAY_STARTUP_TIMEOUT = "The current node timed out during startup"


def start_node(command: str, env: dict[str, str], log: Path, temp_dir: str, attempts: int = 3) -> subprocess.Popen[bytes]:
    """Run a ``ray start`` command and return once its node has registered ("Ray runtime
    started.": with ``--block`` the process keeps running, without it it exits). A start
    that hit :data:`RAY_STARTUP_TIMEOUT` is killed (with its processes, found by their temp
    dir) and run again; any other failure fails the test with the log's tail."""
    for attempt in range(1, attempts + 1):
        proc, printed = _start_once(command, env, log)
        if proc is not None:
            return proc
        kill_all(processes_under(temp_dir))
        if RAY_STARTUP_TIMEOUT not in printed or attempt == attempts:
            raise AssertionError(f"{command!r} failed (attempt {attempt}):\n{printed[-3000:]}")
    raise AssertionError("unreachable: attempts < 1")


def _start_once(command: str, env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
    """One ``ray start``: its process once the node is up, or None and what it printed."""
    offset = log.stat().st_size if log.exists() else 0
    proc = start(command, env, log)

    def printed() -> str:
        return log.read_bytes()[offset:].decode(errors="replace")

    def outcome() -> str | None:
        if "Ray runtime started." in printed():
            return "started"
        return "exited" if proc.poll() is not None else None

    started = wait_until(outcome, f"{command!r} to start its node", 240, explain=lambda: printed()[-3000:]) == "started"
    return (proc if started else None), printed()


def node_dir_of(pid: int, dirs: dict[str, str]) -> str | None:
    """Which of our nodes (by temp dir) a worker process runs on: its raylet parent names it."""
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return None
    return next((name for name, d in dirs.items() if d in cmdline), None)


@contextmanager
def cluster(tmp_path: Path) -> Iterator[tuple[ServiceProcess, dict[str, str], str]]:
    """docker-compose.yml's head, server and second node on loopback, the second node joining
    once the server schedules on the head: yields the service, each node's temp dir and the
    database's URL; everything is killed after."""
    services = compose_services()
    port = free_port()
    dirs = {"head": short_tmpdir("ft12h-"), "node2": short_tmpdir("ft12n-"), "server": short_tmpdir("ft12s-")}
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    artifacts = tmp_path / "artifacts"
    procs: list[subprocess.Popen[bytes]] = []
    service: ServiceProcess | None = None
    try:
        # ray-head, with one CPU here (in production its workers' nodes have the devices).
        head = on_loopback(services["ray-head"]["command"], port).replace("--port=6379", f"--port={port}")
        head = head.replace("--num-cpus=0 --num-gpus=0", "") + f" {node_flags(dirs['head'], 1)} --include-dashboard=false"
        procs.append(start_node(head, {}, tmp_path / "head.log", dirs["head"]))

        # server: its own CPU-less node joins, then `fusetune serve` drives the cluster.
        env = {k: on_loopback(str(v), port) for k, v in services["server"]["environment"].items()}
        admin = secrets.token_urlsafe(24)
        env.update(
            FUSETUNE_DATABASE_URL=url, FUSETUNE_ARTIFACT_STORE=f"file://{artifacts}", FUSETUNE_ADMIN_TOKEN=admin,
            FUSETUNE_HOST="127.0.0.1", FUSETUNE_MAX_ARRAY_SIZE="4", FUSETUNE_CHECKPOINT_INTERVAL_S="0",
            FUSETUNE_DEVICE_REFRESH_S="1", RAY_TMPDIR=dirs["server"], **RAY_ENV,
        )
        service = ServiceProcess(env, tmp_path / "server.log", admin)
        command = on_loopback(services["server"]["command"], port)
        command = command.replace("--num-cpus=0 --num-gpus=0", node_flags(dirs["server"], 0))
        command = command.replace("--host 0.0.0.0 --port 8000", f"--host 127.0.0.1 --port {service.port}")
        # The container runs `bash -c "ray start ... && fusetune serve ..."`: here its two
        # halves run one after the other, so that the node's start can be retried.
        join, serve = shlex.split(command)[-1].split("&&")
        start_node(join.strip(), env, tmp_path / "server-node.log", dirs["server"])
        service.start(shlex.split(serve))
        assert service.healthy(timeout=240)["workers"] == 1  # the head's CPU

        # gpu-worker: a second node joins; the pool starts a worker on it.
        node2 = on_loopback(services["gpu-worker"]["command"], port) + " " + node_flags(dirs["node2"], 1)
        procs.append(start_node(node2, {}, tmp_path / "node2.log", dirs["node2"]))
        wait_until(lambda: httpx.get(f"{service.url}/healthz").json()["workers"] == 2, "a worker on the new node", 120)

        yield service, dirs, url
    finally:
        if service is not None:
            service.stop()
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for d in dirs.values():
            kill_all(processes_under(d))


def test_arrays_run_on_both_nodes_and_a_dead_nodes_members_resume_on_the_head(tmp_path: Path) -> None:
    with cluster(tmp_path) as (service, dirs, url):
        from fusetune.client import Client

        epochs, name = 60, "cluster"
        with Client(service.url, token=service.token()) as client:
            study = client.create_study(
                "digits-mlp", n_trials=8, epochs=epochs, name=name, search_space=ONE_SHAPE, max_array_size=4,
                sampler={"name": "RandomSampler", "kwargs": {"seed": 3}},
            )
            sid = study["id"]
            engine = sa.create_engine(url)

            def placed() -> dict[str, dict] | None:
                arrays = [a for a in client.arrays(sid) if a["state"] == "RUNNING"]
                with engine.connect() as conn:
                    pids = dict(conn.execute(sa.text("SELECT name, node FROM ft_workers")).all())
                    ckpt = dict(conn.execute(sa.text("SELECT id, checkpoint_epoch FROM ft_trials WHERE study_id = :s"), {"s": sid}).all())
                where = {node_dir_of(int(pids[a["worker"]].rsplit(":", 1)[1]), dirs): a for a in arrays}
                ready = set(where) == {"head", "node2"} and all((ckpt[t] or 0) >= 2 for a in arrays for t in a["trial_ids"])
                return where if ready else None

            where = wait_until(placed, "arrays on both nodes, each member checkpointed twice", 240)
            head_node, gone_node = where["head"]["node"], where["node2"]["node"]
            assert head_node and gone_node and head_node != gone_node
            moved = {t["number"] for t in client.trials(sid) if t["id"] in where["node2"]["trial_ids"]}

            # The second node dies: its raylet is killed mid-array (its `ray start --block` then ends the node).
            (raylet,) = [p for p in processes_under(dirs["node2"]) if b"raylet" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0]]
            os.kill(raylet, signal.SIGKILL)
            hit = time.monotonic()
            wait_until(lambda: resumed(client, sid, moved), "the dead node's members to resume", 300)
            recovered = time.monotonic() - hit
            wait_until(lambda: httpx.get(f"{service.url}/healthz").json()["workers"] == 1, "the pool to drop the node's worker", 120)
            done = client.wait(sid, timeout=600)
            assert done["trial_counts"].get("COMPLETE") == 8, done["trial_counts"]
            arrays = client.arrays(sid)
            engine.dispose()

        assert {a["node"] for a in arrays} == {head_node, gone_node}  # arrays ran on both nodes
        died = [a for a in arrays if a["node"] == gone_node]
        assert [a["state"] for a in died] == ["FAIL"]
        trial_ids = {t["number"]: t["id"] for t in Client(service.url, token=service.admin_token).trials(sid)}
        for number in moved:  # each resumed on the head, in a later array
            later = [a for a in arrays if trial_ids[number] in a["trial_ids"] and a["id"] != died[0]["id"]]
            assert later and all(a["node"] == head_node for a in later)
        result = audit(url, name, epochs)
        assert result["unfinished"] == [] and result["states"] == ["COMPLETE"]
        assert result["points_lost"] == 0 and result["points_duplicated"] == 0
        assert set(result["resumed_at_epochs"]) == moved and all(at[0] >= 2 for at in result["resumed_at_epochs"].values())
        record(
            "second node's raylet killed (multi-node cluster)", points_lost=0, points_duplicated=0,
            trials_failed=result["trials_failed"], epochs_retrained=result["epochs_retrained"], trials=8, epochs=epochs, recover_s=round(recovered, 2),
            resumed_at_epochs=result["resumed_at_epochs"], how="measured by tests/test_cluster.py",
        )


#: A tenant's workload in a module of the test's own (a tiny MLP on generated data): each
#: process that builds its model writes its pid and working directory to the marker.
MODULE = '''
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fusetune import Metric, Workload

MARKER = {marker!r}


def build(params):
    with open(MARKER, "a") as f:
        f.write(f"{{os.getpid()}} {{os.getcwd()}}\\n")
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def space(trial):
    return {{"lr": trial.suggest_float("lr", 0.01, 0.3, log=True)}}


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = x[:, :4].argmax(-1)
    return TensorDataset(x[:384], y[:384]), TensorDataset(x[384:], y[384:])


def accuracy(out, y):
    return (out.argmax(-1) == y).float().mean().item()


WORKLOAD = Workload(
    name="cluster-byo", build_model=build, search_space=space, datasets=data, loss=F.cross_entropy, metric=accuracy,
    metrics=(Metric("accuracy", accuracy),), optimizer="SGD", optimizer_defaults={{"lr": 0.1}}, batch_size=64,
)
'''


def worker_nodes(url: str, dirs: dict[str, str]) -> dict[str, tuple[int, str | None]]:
    """Each worker's (pid, node): its process as ``ft_workers`` names it, and which of our nodes runs it."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT name, node FROM ft_workers")).all()
    finally:
        engine.dispose()
    return {name: (pid, node_dir_of(pid, dirs)) for name, pid in ((n, int(node.rsplit(":", 1)[1])) for n, node in rows)}


def test_the_second_node_trains_an_uploaded_workload_whose_code_reached_it_through_ray(tmp_path: Path) -> None:
    """Issue 31's Done-when: a workload of a module no node has (nor the service) is uploaded;
    the second node trains arrays of it, in a worker whose working directory is the package
    as that node's own Ray runtime-env agent unpacked it, under its own temp dir."""
    code, marker = tmp_path / "code", tmp_path / "marker"
    code.mkdir()
    module_name = f"cluster_byo_{secrets.token_hex(4)}"
    (code / f"{module_name}.py").write_text(MODULE.format(marker=str(marker)))
    assert str(code) not in os.environ.get("PYTHONPATH", "")  # the nodes and the service inherit this environment
    sys.path.insert(0, str(code))
    try:
        module = importlib.import_module(module_name)
    finally:
        sys.path.remove(str(code))

    with cluster(tmp_path) as (service, dirs, url):
        import fusetune.client as ft
        from fusetune.client import Client

        with Client(service.url, token=service.admin_token) as admin:
            admin.set_code_upload("default", True)
        token = service.token()
        study = ft.create_study(
            workload=module.WORKLOAD, n_trials=8, epochs=2, max_array_size=2, sampler=optuna.samplers.RandomSampler(seed=5),
            url=service.url, token=token,
        )
        with Client(service.url, token=token) as client:
            (row,) = [s for s in client.studies() if s["name"] == study.study_name]
            done = client.wait(row["id"], timeout=480)
            assert done["state"] == "COMPLETE", (done, service.log_tail())
            assert done["trial_counts"].get("COMPLETE") == 8, done["trial_counts"]
            digest = done["package"]
            arrays = client.arrays(row["id"])
        # A worker restarted in the package's env is a new process: ft_workers names it once the
        # pool's next refresh has heard from it (FUSETUNE_DEVICE_REFRESH_S=1).
        workers = wait_until(
            lambda: (found := worker_nodes(url, dirs)) and None not in {node for _, node in found.values()} and found,
            "each worker's process, on its node", 30, explain=lambda: f"{worker_nodes(url, dirs)}\n{service.log_tail()}",
        )
        serving = {service.proc.pid, *processes_under(f"serve --host 127.0.0.1 --port {service.port}")}
        builds = {(int(pid), cwd) for pid, cwd in (line.split(" ", 1) for line in marker.read_text().splitlines())}
        builders = {pid: node_dir_of(pid, dirs) for pid, _ in builds}  # its describer and workers, alive until the end

    # Arrays ran on both nodes, the second one's among them.
    assert {workers[a["worker"]][1] for a in arrays} == {"head", "node2"}, (arrays, workers)
    # Every process that built the workload's model ran in the package as its own node's Ray
    # runtime-env agent unpacked it from the cluster's GCS, under that node's temp dir ...
    for pid, cwd in builds:
        where, node = Path(cwd), builders[pid]
        assert node is not None and where.is_relative_to(Path(dirs[node]).resolve()), (pid, cwd, node, dirs)
        assert where.name == f"_ray_pkg_fusetune_{digest}" and where.parent.name == "working_dir_files", cwd
        assert where.parent.parent.name == "runtime_resources", cwd
    # ... the second node's worker among them: the code it trained reached node2 through Ray,
    # not through a path it shares with the client or the service.
    (node2_worker,) = [pid for pid, node in workers.values() if node == "node2"]
    assert node2_worker in builders, (node2_worker, builds)
    # No build ran in the service's process (nor in the client's, which only packaged the module).
    assert not builders.keys() & (serving | {os.getpid()}), (serving, builds)
