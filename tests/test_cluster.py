"""A real Ray cluster on loopback, started by docker-compose.yml's own commands.

The Ray head (``ray-head``), a second node (``gpu-worker``; here its CPU) and the server
(``server``: its CPU-less Ray node, then ``fusetune serve``) run the commands their
containers run, read from docker-compose.yml; the test only adds what one host needs to run
several nodes at once: each node's temp dir, CPU count and ports, and the addresses of
loopback for the containers' host names. Arrays run on both nodes; the pool follows the
second node as it joins and when its raylet is killed mid-array, and that node's members
resume on the head from the shared artifact store.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import optuna
import pytest
import sqlalchemy as sa
import yaml

from tests.faults import ROOT, ServiceProcess, audit, kill_all, processes_under, record, resumed, short_tmpdir, wait_until

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {
    "hidden": D.distribution_to_json(D.CategoricalDistribution([32])),
    "lr": D.distribution_to_json(D.FloatDistribution(0.01, 0.1)),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def node_dir_of(pid: int, dirs: dict[str, str]) -> str | None:
    """Which of our nodes (by temp dir) a worker process runs on: its raylet parent names it."""
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return None
    return next((name for name, d in dirs.items() if d in cmdline), None)


def test_arrays_run_on_both_nodes_and_a_dead_nodes_members_resume_on_the_head(tmp_path: Path) -> None:
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
        procs.append(start(head, {}, tmp_path / "head.log"))

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
        service.start(shlex.split(command))
        assert service.healthy(timeout=240)["workers"] == 1  # the head's CPU

        # gpu-worker: a second node joins; the pool starts a worker on it.
        node2 = on_loopback(services["gpu-worker"]["command"], port) + " " + node_flags(dirs["node2"], 1)
        procs.append(start(node2, {}, tmp_path / "node2.log"))
        wait_until(lambda: httpx.get(f"{service.url}/healthz").json()["workers"] == 2, "a worker on the new node", 120)

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
            epochs_retrained=result["epochs_retrained"], trials=8, epochs=epochs, recover_s=round(recovered, 2),
            resumed_at_epochs=result["resumed_at_epochs"], how="measured by tests/test_cluster.py",
        )
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
