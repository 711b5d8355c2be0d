"""docker-compose.yml is valid and its containers run commands that exist in this package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_file_has_the_production_services() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", "ray-head", "server", "gpu-worker"}
    assert services["server"]["environment"]["FUSETUNE_DATABASE_URL"].startswith("postgresql+psycopg://")
    # Workers report through the control plane: no other container gets the credentials.
    for name in ("ray-head", "gpu-worker"):
        assert "FUSETUNE_DATABASE_URL" not in (services[name].get("environment") or {})
    gpus = services["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpus["capabilities"] == ["gpu"]


def test_docker_compose_config_accepts_the_file() -> None:
    binary = shutil.which("docker-compose") or shutil.which("docker")
    assert binary, "neither docker-compose nor docker is installed (see the Makefile's test target)"
    args = [binary, "config", "-q"] if binary.endswith("docker-compose") else [binary, "compose", "config", "-q"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_server_container_command_exists() -> None:
    command = compose()["services"]["server"]["command"]
    assert "fusetune serve --host 0.0.0.0 --port 8000" in command
    done = subprocess.run([sys.executable, "-m", "fusetune.server.cli", "serve", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "--host" in done.stdout and "--port" in done.stdout


def test_every_fusetune_container_mounts_the_one_artifact_volume() -> None:
    """Checkpoints written on one node resume on another: server, head and workers share the store."""
    spec = compose()
    services = spec["services"]
    assert "artifacts" in spec["volumes"] and "pgdata" in spec["volumes"]
    store = services["server"]["environment"]["FUSETUNE_ARTIFACT_STORE"]
    assert store.startswith("file:///")
    mount = store.removeprefix("file://")
    for name in ("server", "ray-head", "gpu-worker"):
        volumes = services[name].get("volumes") or []
        assert f"artifacts:{mount}" in volumes, (name, volumes)
    assert "artifacts" not in str(services["postgres"]["volumes"])
    # The server reaches the cluster at the head's address (never "auto", which picks whichever
    # cluster this host started last), through its own CPU-less Ray node.
    assert services["server"]["environment"]["FUSETUNE_RAY_ADDRESS"] == "ray-head:6379"
    assert "ray start --address=ray-head:6379 --num-cpus=0" in services["server"]["command"]
    assert services["postgres"]["healthcheck"]["test"]
