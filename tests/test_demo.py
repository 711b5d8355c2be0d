"""`make run`'s job: `fusetune demo` finishes the 16-trial digits sweep in fused arrays."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import optuna
import pytest

from fusetune.server.cli import BackgroundServer
from fusetune.server.settings import Settings
from tests.conftest import free_port

pytestmark = pytest.mark.slow


def test_demo_sweep(ray_cluster: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FUSETUNE_RAY_ADDRESS": ray_cluster,
        "FUSETUNE_PORT": str(free_port()),
        "FUSETUNE_DATABASE_URL": "sqlite:///./fusetune.db",
        # The session's Ray has 4 logical CPUs; `make run` on this 2-core machine starts 2 workers.
        "FUSETUNE_CPU_WORKERS": "2",
    }
    for leftover in ("FUSETUNE_ADMIN_TOKEN", "FUSETUNE_TOKEN"):  # the embedded default: none configured
        env.pop(leftover, None)
    # As `make run` runs it: the sweep, then serving until stopped; stopped here by SIGTERM
    # (kill, a container's stop), which ends it as Ctrl-C does.
    stderr = (tmp_path / "demo.err").open("w+")  # a file: a pipe nobody reads could fill and stop it
    demo = subprocess.Popen(
        [sys.executable, "-m", "fusetune.server.cli", "demo", "--timeout", "290"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    assert demo.stdout is not None
    lines = []
    for line in demo.stdout:  # until it serves (or ends: the sweep failed)
        lines.append(line)
        if line.startswith("serving until interrupted"):
            demo.send_signal(signal.SIGTERM)
            break
    rest, _ = demo.communicate(timeout=120)
    out = "".join(lines) + rest
    stderr.seek(0)
    err = stderr.read()
    stderr.close()
    assert demo.returncode == 0, out + err
    assert "SIGTERM received" not in err, err

    sizes = [int(n) for n in re.findall(r"array \d+: (\d+) trials", out)]
    assert sum(sizes) == 16
    assert min(sizes) >= 4, out
    best = float(re.search(r"best trial #\d+: accuracy ([0-9.]+)", out).group(1))
    assert best >= 0.90, out
    assert "/docs" in out

    # The database the demo wrote is in the directory it ran from, and Optuna can read it.
    name = re.search(r"study_name='([^']+)'", out).group(1)
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'fusetune.db'}")
    assert len(study.trials) == 16
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert {t.params["hidden"] for t in study.trials} == {32, 64}
    assert study.best_value == pytest.approx(best, abs=1e-4)

    # The token it printed is the local tenant's, and works on a later server of that database.
    tokens = set(re.findall(r"export FUSETUNE_URL=\S+ FUSETUNE_TOKEN=(\S+)", out))
    assert len(tokens) == 1, out
    # With the service's own URL, which the client and the CLI read.
    (url,) = set(re.findall(r"export FUSETUNE_URL=(\S+) ", out))
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
    token = tokens.pop()
    assert "Authorization: Bearer $FUSETUNE_TOKEN" in out
    # The dashboard's URL logs in with that same token (the page keeps it from the fragment).
    assert set(re.findall(r"/#token=(\S+)", out)) == {token}, out
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'fusetune.db'}", port=free_port())
    server = BackgroundServer(settings, schedule=False).start()
    try:
        studies = httpx.get(f"{server.url}/api/v1/studies", headers={"Authorization": f"Bearer {token}"})
        assert studies.status_code == 200
        assert [(s["name"], s["tenant"], s["state"]) for s in studies.json()] == [(name, "default", "COMPLETE")]
        assert httpx.get(f"{server.url}/api/v1/studies").status_code == 401
        assert "dashboard/app.js" in httpx.get(f"{server.url}/").text  # the page itself needs no token
        # The admin token was this run's only.
        admin = re.search(r"admin token of this run.*\n\s+(\S+)", out).group(1)
        assert httpx.get(f"{server.url}/api/v1/studies", headers={"Authorization": f"Bearer {admin}"}).status_code == 401
    finally:
        server.stop()
