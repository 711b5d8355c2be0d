"""Reads of a live sweep trained by Ray workers: a poller that downloads only changes ends with
exactly what the full listing shows, and each trained trial's saved weights download and load
strict into the workload's model."""

from __future__ import annotations

import io
import time
from pathlib import Path

import optuna
import pytest
import torch

from fusetune.client import FusetuneError
from fusetune.workers.workloads import get_workload
from tests.conftest import running_service

pytestmark = pytest.mark.slow

SPACE = {
    "lr": optuna.distributions.distribution_to_json(optuna.distributions.FloatDistribution(0.01, 0.3, log=True)),
    "hidden": optuna.distributions.distribution_to_json(optuna.distributions.CategoricalDistribution([16, 32])),
}


def test_a_poller_sees_every_change_and_trained_weights_load_strict(ray_cluster: str, database_url: str, tmp_path: Path) -> None:
    with running_service(ray_cluster, database_url, max_array_size=4, artifact_dir=tmp_path) as client:
        study = client.create_study(
            "digits-mlp", n_trials=3, epochs=4, name="read-back", search_space=SPACE,
            sampler={"name": "RandomSampler", "kwargs": {"seed": 5}},
            pruner={"name": "MedianPruner", "kwargs": {"n_startup_trials": 2, "n_warmup_steps": 1}},
        )
        # Two phases, so that the poller's second phase starts from a revision in the middle
        # of the study's history whatever the speed of this machine: three trials run to the
        # end, then the study is given three more.
        seen: dict[int, dict] = {}
        since = 0
        for n_trials in (3, 6):
            if n_trials > study["n_trials"]:
                study = client.update_study(study["id"], n_trials=n_trials)
            before = set(seen)
            deadline = time.monotonic() + 300
            while True:
                done = client.study(study["id"])["completed_at"] is not None
                rows, since = client.changes(study["id"], since)  # after the check: nothing changes once it is done
                assert len({r["id"] for r in rows}) == len(rows), "a change came twice in one poll"
                seen.update({r["id"]: r for r in rows})
                if done:
                    break
                assert time.monotonic() < deadline, "the study did not finish"
                time.sleep(0.3)
            assert len(seen) == n_trials and before < set(seen)  # each phase downloads its new trials
            everything = client.trials(study["id"])
            assert seen == {r["id"]: r for r in everything}  # the changes add up to the listing
            assert client.changes(study["id"], since) == ([], since)

        workload = get_workload("digits-mlp")
        _, validation = workload.datasets()
        inputs, targets = validation.tensors
        complete = [t for t in everything if t["state"] == "COMPLETE"]
        assert complete
        for trial in everything:
            if trial["state"] != "COMPLETE":
                with pytest.raises(FusetuneError) as missing:
                    client.download_state_dict(trial["id"])
                assert missing.value.status_code == 404
                continue
            weights = client.download_state_dict(trial["id"], tmp_path / "download.pt")
            assert (tmp_path / "download.pt").read_bytes() == weights
            model = workload.build_model(trial["params"])
            model.load_state_dict(torch.load(io.BytesIO(weights)), strict=True)
            model.eval()
            with torch.no_grad():
                accuracy = workload.metric(model(inputs), targets)
            # The weights it completed with: the accuracy it reported (two samples' leeway for
            # a fused pass's rounding at an arg-max tie).
            assert accuracy == pytest.approx(trial["value"], abs=2 / len(targets))
