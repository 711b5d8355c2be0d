"""On CPU workers, arrays respect a memory budget (FUSETUNE_WORKER_MEMORY_BYTES) through the
fusion engine's memory model: bytes(B) = base + B * member, measured from fused arrays of one
and two members (fusion.sizing.memory_model), on a worker: never in the server's process."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from fusetune.fusion import sizing
from fusetune.workers.memory import array_memory_model
from fusetune.workers.workloads import get_workload
from tests.conftest import members_at_once, running_service

pytestmark = pytest.mark.slow
D = optuna.distributions


def test_arrays_fit_the_memory_budget(ray_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = {"hidden": 64, "lr": 0.05, "momentum": 0.0, "weight_decay": 1e-4}
    base, member = array_memory_model(get_workload("digits-mlp"), params)
    # The service runs in this process (its workers in Ray's): from here on, a memory model
    # measured here would be the server training a step of a tenant's model.
    in_server: list[object] = []
    monkeypatch.setattr(sizing, "memory_model", lambda *args, **kwargs: in_server.append(args) or (0, 0))
    assert base > 0 and member > 0
    budget = base + int(2.5 * member)  # two members fit, three do not
    space = {
        "hidden": D.distribution_to_json(D.CategoricalDistribution([64])),
        "lr": D.distribution_to_json(D.FloatDistribution(0.01, 0.1)),
    }
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    with running_service(ray_cluster, url, cpu_workers=1, max_array_size=8, worker_memory_bytes=budget,
                         artifact_dir=tmp_path / "artifacts") as client:
        study = client.create_study("digits-mlp", n_trials=6, epochs=2, name="budget", search_space=space,
                                    sampler={"name": "RandomSampler", "kwargs": {"seed": 0}})
        done = client.wait(study["id"], timeout=300)
        arrays = client.arrays(study["id"])
        widest = members_at_once(url, study["id"])
    assert done["trial_counts"].get("COMPLETE") == 6
    assert sum(a["size"] for a in arrays) == 6
    # As many at once as the budget allows, never more (an array may go on with successors).
    assert max(widest.values()) == 2
    assert all(base + b * member <= budget for b in widest.values())
    assert in_server == []  # measured on the worker


@pytest.mark.parametrize(("budget", "width", "whose"), [
    # No budget: a width whose first hidden x hidden layer alone is 4 TB of weights, more than
    # any machine's memory, so nothing may ever try to allocate it.
    (None, 1_000_000, "the largest worker's memory"),
    # A budget of 1 MiB: a 512-wide member has 1.2 MB of weights alone, a 32-wide one 14 kB.
    (1 << 20, 512, "FUSETUNE_WORKER_MEMORY_BYTES"),
])
def test_a_trial_no_worker_can_hold_fails_before_anything_allocates_it(
    ray_cluster: str, tmp_path: Path, budget: int | None, width: int, whose: str,
) -> None:
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    huge = {"hidden": D.distribution_to_json(D.CategoricalDistribution([width]))}
    small = {"hidden": D.distribution_to_json(D.CategoricalDistribution([32]))}
    with running_service(ray_cluster, url, cpu_workers=1, worker_memory_bytes=budget,
                         artifact_dir=tmp_path / "artifacts") as client:
        big = client.create_study("digits-mlp", n_trials=3, epochs=1, name="too-large", search_space=huge)
        fits = client.create_study("digits-mlp", n_trials=2, epochs=1, name="fits", search_space=small)
        big_done, fits_done = client.wait(big["id"], timeout=300), client.wait(fits["id"], timeout=300)
        trials, arrays = client.trials(big["id"]), client.arrays(big["id"])
    assert big_done["state"] == "FAILED"
    assert [t["state"] for t in trials] == ["FAIL"] * 3
    for trial in trials:
        assert "needs at least" in trial["error"] and whose in trial["error"], trial["error"]
        assert "no worker can train it" in trial["error"]
    assert arrays == []  # refused when asked: no worker built or trained it
    assert fits_done["state"] == "COMPLETE" and fits_done["trial_counts"]["COMPLETE"] == 2
