"""The fault matrix: the database unreachable for 30 s mid-sweep (PostgreSQL behind a TCP proxy
that the test cuts and restores). Its own module, so that the service of tests/test_faults.py
has given the session's Ray its CPUs back."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest

from fusetune.workers.checkpoints import checkpoint_dir, saved_epochs
from fusetune.workers.store import get_store
from tests.conftest import _postgres_database, running_service
from tests.faults import audit, proxied, record, reported_steps, wait_until

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {
    "hidden": D.distribution_to_json(D.CategoricalDistribution([32])),
    "lr": D.distribution_to_json(D.FloatDistribution(0.01, 0.1)),
}


def test_the_database_unreachable_for_30_s(ray_cluster: str, tmp_path: Path) -> None:
    """PostgreSQL behind a TCP proxy that the test cuts for 30 s mid-sweep: workers train on,
    their reports wait in the control plane, and once the database is back every one is written."""
    direct = next(_postgres_generator := _postgres_database())
    try:
        with proxied(direct) as (url, proxy):
            artifacts = tmp_path / "artifacts"
            with running_service(
                ray_cluster, url, cpu_workers=1, max_array_size=4, artifact_dir=artifacts, checkpoint_interval_s=0,
                db_retry_s=0.5,
            ) as client:
                epochs, name = 200, "fault-db"
                study = client.create_study(
                    "digits-mlp", n_trials=4, epochs=epochs, name=name, search_space=ONE_SHAPE,
                    sampler={"name": "RandomSampler", "kwargs": {"seed": 2}},
                )
                wait_until(lambda: (s := reported_steps(direct, name)) and len(s) == 4 and min(s.values()) >= 3, "3 epochs")
                store = get_store(str(artifacts.resolve()))

                def trained() -> list[int]:  # each member's newest checkpoint: how far it trained
                    return [max(saved_epochs(store, checkpoint_dir(name, n)), default=0) for n in range(4)]

                proxy.cut()
                cut_at, before = time.monotonic(), reported_steps(direct, name)
                first = trained()
                time.sleep(30)  # the fault itself lasts 30 s; nothing waits on it
                during = trained()
                assert reported_steps(direct, name) == before, "something reached the database through the cut"
                proxy.restore()
                restored = time.monotonic()
                wait_until(lambda: sum(reported_steps(direct, name).values()) > sum(before.values()), "the first write after", 120)
                recovered = time.monotonic() - restored
                done = client.wait(study["id"], timeout=600)
                assert done["trial_counts"].get("COMPLETE") == 4, done["trial_counts"]
        # Workers kept training through the outage (their checkpoints moved on, or they finished).
        assert any(d > f for d, f in zip(during, first)) or all(d == 0 for d in during), (first, during)
        result = audit(direct, name, epochs)
        assert result["unfinished"] == [] and result["states"] == ["COMPLETE"]
        assert result["points_lost"] == 0 and result["points_duplicated"] == 0 and result["epochs_retrained"] == 0
        record(
            "database unreachable for 30 s (TCP proxy cut)", points_lost=0, points_duplicated=0,
            trials_failed=result["trials_failed"], epochs_retrained=0,
            trials=4, epochs=epochs, recover_s=round(recovered, 2), outage_s=round(restored - cut_at, 1),
            epochs_trained_during_outage=sum(during) - sum(first), how="measured by tests/test_faults_db.py",
        )
    finally:
        _postgres_generator.close()


def test_an_outage_far_longer_than_the_pruning_deadline_fails_nothing(ray_cluster: str, tmp_path: Path) -> None:
    """A study with a pruner, its database cut (the TCP proxy) for many times its arrays'
    deadline for a pruning decision: 15 minutes against the default 60 s, here scaled through
    the setting (FUSETUNE_PRUNE_REPLY_TIMEOUT_S = 1 s, the cut lasting 15 deadlines at least).

    The arrays go on past each deadline as if told to continue; no trial fails and no
    checkpoint goes. Once the database is back every report is written, the late decisions
    are made (a member pruned late stops at a later boundary, and what it trained after the
    decision is not stored), and the study ends with every point stored once."""
    direct = next(_postgres_generator := _postgres_database())
    try:
        with proxied(direct) as (url, proxy):
            artifacts = tmp_path / "artifacts"
            with running_service(
                ray_cluster, url, cpu_workers=1, max_array_size=4, artifact_dir=artifacts, checkpoint_interval_s=0,
                db_retry_s=0.5, prune_reply_timeout_s=1.0,
            ) as client:
                epochs, name = 120, "fault-db-pruned"
                study = client.create_study(
                    "digits-mlp", n_trials=4, epochs=epochs, name=name, search_space=ONE_SHAPE,
                    sampler={"name": "RandomSampler", "kwargs": {"seed": 5}},
                    pruner={"name": "MedianPruner", "kwargs": {"n_startup_trials": 0, "n_warmup_steps": 40}},
                )
                wait_until(lambda: (s := reported_steps(direct, name)) and len(s) == 4 and min(s.values()) >= 3, "3 epochs")
                store = get_store(str(artifacts.resolve()))

                def trained() -> list[int]:  # each member's newest checkpoint: how far it trained
                    return [max(saved_epochs(store, checkpoint_dir(name, n)), default=0) for n in range(4)]

                proxy.cut()
                cut_at, before, first = time.monotonic(), reported_steps(direct, name), trained()
                # The arrays wait at most 1 s per boundary for a decision that cannot come: each
                # member 15 epochs past the cut is 15 deadlines over, the 15 minutes of the issue.
                wait_until(lambda: all(t - f >= 15 for t, f in zip(trained(), first)), "15 epochs each through the outage", 300)
                assert reported_steps(direct, name) == before, "something reached the database through the cut"
                proxy.restore()
                restored = time.monotonic()
                wait_until(lambda: sum(reported_steps(direct, name).values()) > sum(before.values()), "the first write after", 120)
                recovered = time.monotonic() - restored
                done = client.wait(study["id"], timeout=600)
        counts = {k: v for k, v in done["trial_counts"].items() if v}
        assert set(counts) <= {"COMPLETE", "PRUNED"} and sum(counts.values()) == 4, counts
        result = audit(direct, name, epochs)
        assert result["unfinished"] == [] and result["points_lost"] == 0 and result["points_duplicated"] == 0, result
        assert "FAIL" not in result["states"]
        record(
            "database unreachable for 15 pruning deadlines, study with a pruner", points_lost=0, points_duplicated=0,
            trials_failed=result["trials_failed"], epochs_retrained=result["epochs_retrained"], trials=4, epochs=epochs,
            recover_s=round(recovered, 2), outage_s=round(restored - cut_at, 1), prune_reply_timeout_s=1.0,
            states=counts, how="measured by tests/test_faults_db.py (the deadline scaled from 60 s to 1 s)",
        )
    finally:
        _postgres_generator.close()
