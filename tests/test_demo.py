"""`make run`'s job: `fusetune demo` finishes the 16-trial digits sweep in fused arrays."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

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
    done = subprocess.run(
        [sys.executable, "-m", "fusetune.server.cli", "demo", "--exit", "--timeout", "290"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr

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
