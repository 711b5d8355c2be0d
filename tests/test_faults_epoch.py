"""The fault matrix's epoch deadline: an epoch that never ends (``FUSETUNE_EPOCH_TIMEOUT_S``).

A module of its own, with a service of its own: its epoch deadline is short, so the other
faults' studies (tests/test_faults.py) train where no deadline can cut a slow epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from fusetune.client import Client
from tests.faults import GUARD_S, audit, faults_service, record

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {
    "hidden": D.distribution_to_json(D.CategoricalDistribution([32])),
    "lr": D.distribution_to_json(D.FloatDistribution(0.01, 0.1)),
}
#: Far below what the endless workload's epoch takes (for ever); an array's setup does not count.
EPOCH_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def service(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Client, str, Path]]:
    with faults_service(ray_cluster, tmp_path_factory.mktemp("epoch"), epoch_timeout_s=EPOCH_TIMEOUT_S) as found:
        yield found


def test_an_epoch_that_never_ends_fails_its_trials_and_frees_its_worker(service: tuple[Client, str, Path]) -> None:
    """The endless workload's first epoch never ends, though its worker answers every heartbeat.
    Past FUSETUNE_EPOCH_TIMEOUT_S its worker is killed and replaced; its trials fail with an error
    naming the setting (they do not resume, to overrun again); the next study trains on the new
    worker (the service has one)."""
    client, url, _ = service
    endless = client.create_study(
        "tests.endless_workload:WORKLOAD", n_trials=2, epochs=2, name="fault-endless", search_space=ONE_SHAPE,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 3}},
    )
    failed = client.wait(endless["id"], timeout=GUARD_S)
    assert failed["state"] == "FAILED" and {k: n for k, n in failed["trial_counts"].items() if n} == {"FAIL": 2}
    trials = client.trials(endless["id"])
    assert all("FUSETUNE_EPOCH_TIMEOUT_S" in t["error"] and "10 s" in t["error"] for t in trials), trials
    (array,) = client.arrays(endless["id"])  # one array of both: neither was resumed elsewhere
    assert array["state"] == "FAIL" and "epoch timeout" in array["error"]
    after = client.create_study(
        "digits-mlp", n_trials=2, epochs=2, name="fault-after-endless", search_space=ONE_SHAPE,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 4}},
    )
    done = client.wait(after["id"], timeout=GUARD_S)
    assert done["state"] == "COMPLETE" and done["trial_counts"].get("COMPLETE") == 2
    result = audit(url, "fault-after-endless", 2)
    assert result["points_lost"] == 0 and result["points_duplicated"] == 0
    record(
        "an epoch never ends (epoch timeout 10 s)", points_lost=0, points_duplicated=0, trials_failed=2,
        epochs_retrained=0, trials=2, epochs=2, recover_s=None,
        how="measured by tests/test_faults_epoch.py (its trials fail; the next study trains on the replaced worker)",
    )
