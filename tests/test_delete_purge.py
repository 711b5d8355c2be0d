"""Deleting a large study hides it at once and removes its rows in batches, off the scheduling
loop: another study's arrays train on meanwhile (server/purge.py).

A study of more than ``FUSETUNE_DELETE_BATCH_TRIALS`` trials (here 2, so a 12-trial study
is "large") is hidden in one short transaction: 404 at once, listed nowhere, its Optuna study
no longer found by its name. Its rows then go in batches on the purger's thread. On
PostgreSQL the test holds a row lock that stops the purger inside its first batch, and
another study's array reports epoch after epoch while the purge waits: the purge cannot
stall the loop. Once the lock is let go the rows are gone, ``study.deleted`` is recorded,
and the name is free again.
"""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa

from fusetune.client import FusetuneError
from tests.conftest import running_service

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {"hidden": D.distribution_to_json(D.CategoricalDistribution([32]))}


def until(what: str, condition, timeout: float = 240):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def count(engine: sa.Engine, sql: str, **params: object) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar_one()


def test_a_large_study_is_hidden_at_once_and_its_rows_go_while_others_train(
    ray_cluster: str, database_url: str, tmp_path: Path
) -> None:
    engine = sa.create_engine(database_url)
    postgres = engine.dialect.name == "postgresql"
    with running_service(ray_cluster, database_url, cpu_workers=1, max_array_size=12, delete_batch_trials=2,
                         artifact_dir=tmp_path / "artifacts") as client:
        big = client.create_study("digits-mlp", n_trials=12, epochs=2, name="big", search_space=ONE_SHAPE)
        assert client.wait(big["id"], timeout=300)["state"] == "COMPLETE"
        optuna_id = optuna.load_study(study_name="big", storage=database_url)._study_id
        neighbour = client.create_study(  # trials of 10,000 epochs one after the other: it runs as long as the test
            "digits-mlp", n_trials=20, epochs=10_000, max_array_size=1, name="neighbour", search_space=ONE_SHAPE)

        def neighbour_epochs() -> int:
            return count(engine, "SELECT COUNT(*) FROM ft_events WHERE study_id = :s AND kind = 'trial.reported'", s=neighbour["id"])

        until("the neighbour to train", neighbour_epochs)
        blocker = engine.connect() if postgres else None
        try:
            if blocker is not None:  # the purger's first DELETE of Optuna's trials waits for this lock
                blocker.execute(sa.text("SELECT trial_id FROM trials WHERE study_id = :s FOR UPDATE"), {"s": optuna_id})

            assert client.delete_study(big["id"]) is None  # 204: gone from the API...
            with pytest.raises(FusetuneError) as missing:
                client.study(big["id"])
            assert missing.value.status_code == 404
            assert "big" not in [s["name"] for s in client.studies()]
            with pytest.raises(KeyError):
                optuna.load_study(study_name="big", storage=database_url)

            if blocker is not None:
                # ...while its rows are being removed: the purger waits in its first batch, and
                # the neighbour's array goes on reporting epoch after epoch meanwhile.
                until("the purger to wait for the lock", lambda: count(
                    engine, "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'DELETE FROM trials%'"
                ))
                seen = neighbour_epochs()
                until("three more epochs of the neighbour", lambda: neighbour_epochs() >= seen + 3)
                assert count(engine, "SELECT COUNT(*) FROM trials WHERE study_id = :s", s=optuna_id) == 12
                assert count(engine, "SELECT COUNT(*) FROM ft_studies WHERE id = :s", s=big["id"]) == 1
        finally:
            if blocker is not None:
                blocker.rollback()
                blocker.close()

        until("the big study's rows to be removed", lambda: count(
            engine, "SELECT COUNT(*) FROM ft_studies WHERE id = :s", s=big["id"]) == 0)
        for sql in (
            "SELECT COUNT(*) FROM ft_trials WHERE study_id = :s",
            "SELECT COUNT(*) FROM ft_arrays WHERE study_id = :s",
            "SELECT COUNT(*) FROM ft_trial_revisions WHERE study_id = :s",
        ):
            assert count(engine, sql, s=big["id"]) == 0, sql
        for sql in (
            "SELECT COUNT(*) FROM trials WHERE study_id = :s",
            "SELECT COUNT(*) FROM studies WHERE study_id = :s",
            "SELECT COUNT(*) FROM study_directions WHERE study_id = :s",
            "SELECT COUNT(*) FROM trial_intermediate_values v JOIN trials t ON t.trial_id = v.trial_id WHERE t.study_id = :s",
        ):
            assert count(engine, sql, s=optuna_id) == 0, sql
        orphans = "SELECT COUNT(*) FROM ft_array_members m LEFT JOIN ft_trials t ON m.trial_id = t.id WHERE t.id IS NULL"
        assert count(engine, orphans) == 0
        assert count(engine, "SELECT COUNT(*) FROM ft_events WHERE study_id = :s AND kind = 'study.deleted'", s=big["id"]) == 1
        assert not (tmp_path / "artifacts" / "big").exists()
        client.cancel_study(neighbour["id"])  # it frees the worker for the next study
        again = client.create_study("digits-mlp", n_trials=1, epochs=1, name="big", search_space=ONE_SHAPE)  # the name is free
        assert client.wait(again["id"], timeout=300)["state"] == "COMPLETE"
    engine.dispose()
