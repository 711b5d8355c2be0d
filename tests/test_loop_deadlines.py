"""Nothing waits on the control plane past its deadline: an array whose pruning decision never
comes goes on (FUSETUNE_PRUNE_REPLY_TIMEOUT_S), and a request the busy scheduling loop does not
take up in time is withdrawn and answered 503, never carried out later
(FUSETUNE_LOOP_CALL_TIMEOUT_S). Both deadlines are shortened through their settings."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy as sa

from fusetune.client import FusetuneError
from tests.conftest import _postgres_database, running_service

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {"hidden": D.distribution_to_json(D.CategoricalDistribution([32]))}


def until(what: str, condition, timeout: float = 240):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


def test_a_client_that_never_decides_holds_no_device(ray_cluster: str, tmp_path: Path) -> None:
    """A client-driven study decides its trials' pruning itself; this client never answers.
    Its array goes on past each boundary's deadline as if told to continue, and its trials
    complete: the device is not held for the client (it was, 10 minutes a boundary)."""
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    with running_service(ray_cluster, url, cpu_workers=1, prune_reply_timeout_s=0.5, artifact_dir=tmp_path / "artifacts") as client:
        study = client.create_study("digits-mlp", n_trials=2, epochs=6, name="silent-client", search_space=ONE_SHAPE,
                                    driver="client")
        trials = [client.enqueue_trial(study["id"], {"hidden": 32}) for _ in range(2)]
        done = client.wait(study["id"], timeout=300)
        assert done["trial_counts"]["COMPLETE"] == 2, done["trial_counts"]
        stored = {t["id"]: sorted(map(int, t["intermediate_values"])) for t in client.trials(study["id"])}
        assert stored == {t["id"]: list(range(6)) for t in trials}
        with pytest.raises(FusetuneError) as late:  # a decision for a boundary long passed
            client.decide_pruning(trials[0]["id"], step=0, prune=True)
        assert late.value.status_code == 409


def test_a_request_the_busy_loop_does_not_take_up_is_withdrawn_and_answered_503(ray_cluster: str, tmp_path: Path) -> None:
    """PostgreSQL: the test holds a row lock on the study's running array, so the scheduling
    loop waits inside its next array-epoch transaction. A pause sent meanwhile is not taken up
    within FUSETUNE_LOOP_CALL_TIMEOUT_S: it is a 503 and is withdrawn. Once the lock goes, the
    loop records epoch after epoch, and the study was never paused."""
    generator = _postgres_database()
    url = next(generator)
    engine = sa.create_engine(url)
    try:
        with running_service(ray_cluster, url, cpu_workers=1, loop_call_timeout_s=1.0, artifact_dir=tmp_path / "artifacts") as client:
            study = client.create_study("digits-mlp", n_trials=1, epochs=10_000, name="busy-loop", search_space=ONE_SHAPE)

            def epochs() -> int:
                with engine.connect() as conn:
                    return conn.execute(sa.text("SELECT COALESCE(MAX(epochs_done), 0) FROM ft_arrays WHERE study_id = :s"),
                                        {"s": study["id"]}).scalar_one()

            until("the array to train", epochs)
            with engine.connect() as blocker:
                blocker.execute(sa.text("SELECT id FROM ft_arrays WHERE study_id = :s FOR UPDATE"), {"s": study["id"]})
                until("the loop to wait for the lock", lambda: _waiting_on_a_lock(engine))
                with pytest.raises(FusetuneError) as busy:
                    client.pause_study(study["id"])
                assert busy.value.status_code == 503
                blocker.rollback()
            seen = epochs()
            until("more epochs recorded after the lock", lambda: epochs() >= seen + 3)
            assert client.study(study["id"])["state"] == "RUNNING"  # the withdrawn pause never ran
            client.cancel_study(study["id"])
    finally:
        engine.dispose()
        generator.close()


def _waiting_on_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        return bool(conn.execute(sa.text(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )).scalar_one())
