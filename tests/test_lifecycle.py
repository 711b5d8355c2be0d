"""A study's lifecycle on a live service (uvicorn, the scheduling loop, real Ray workers):
pause and resume, cancel, delete, more trials, and failing; on SQLite and PostgreSQL.

Every wait here waits for the event itself (a trial's first epoch, a row, a file, a state),
never for a guessed duration. Sweeps that must still be running when an action comes train
for hundreds of epochs: the action takes effect at the next epoch boundary, so they end soon.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import optuna
import pytest
import sqlalchemy as sa

from fusetune.client import Client, FusetuneError
from fusetune.server.cli import main as cli
from fusetune.server.db import get_engine, get_sessionmaker
from fusetune.server.schemas import TenantCreate
from fusetune.server.tenants import create_tenant
from fusetune.workers.workloads import register_workload
from fusetune.workers.workloads._digits import DIGITS_MLP
from fusetune.workers.workloads._registry import _registered
from tests.conftest import _postgres_database, running_service
from tests.sse import events_of

pytestmark = pytest.mark.slow
D = optuna.distributions
#: One shape (lr is per member): a study's trials fuse into as few arrays as the cap allows.
ONE_SHAPE = {"lr": D.distribution_to_json(D.FloatDistribution(0.05, 0.3))}
LONG = 400  # epochs of a sweep that must still train when an action comes
TIMEOUT = 900.0  # a guard against hanging, not a guess at how long anything takes (a loaded box: seconds an epoch)


@dataclasses.dataclass
class Service:
    client: Client  # the tenant ``default``
    other: Client  # the tenant ``other``
    url: str  # the database
    artifacts: Path

    def token_of(self, tenant: str, **quotas: Any) -> str:
        """A new tenant's token, made on the database (the clients hold no admin token)."""
        with get_sessionmaker(self.url)() as session:
            return create_tenant(session, TenantCreate(name=tenant, **quotas)).token.token


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def live(request: pytest.FixtureRequest, ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One live service per database for the module: two CPU workers, arrays of up to four."""
    root = tmp_path_factory.mktemp("lifecycle")
    urls = iter([f"sqlite:///{root / 'fusetune.db'}"]) if request.param == "sqlite" else _postgres_database()
    url = next(urls)
    try:
        with running_service(
            ray_cluster, url, cpu_workers=2, max_array_size=4, artifact_dir=root / "artifacts", checkpoint_interval_s=0
        ) as client:
            with get_sessionmaker(url)() as session:
                token = create_tenant(session, TenantCreate(name="other")).token.token
            with Client(client.url, token=token) as other:
                yield Service(client, other, url, root / "artifacts")
    finally:
        for _ in urls:  # drops the PostgreSQL database
            pass


def until(what: str, condition: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    """Poll ``condition`` until it returns something true; that is returned."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def trained(client: Client, study_id: int) -> list[dict[str, Any]]:
    """The study's trials that are in an array and have reported an epoch (empty: none yet)."""
    trials = client.trials(study_id)
    return [t for t in trials if t["state"] == "RUNNING" and t["intermediate_values"]]


def sweep(client: Client, name: str, n_trials: int, epochs: int, **fields: Any) -> dict[str, Any]:
    return client.create_study(
        "digits-mlp", n_trials=n_trials, epochs=epochs, name=name, search_space=ONE_SHAPE,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 1}}, **fields,
    )


def snapshot(client: Client, study_id: int) -> dict[int, dict[str, Any]]:
    keys = ("number", "params", "distributions", "state", "value", "values", "intermediate_values", "error", "user_attrs")
    return {t["id"]: {k: t[k] for k in keys} for t in client.trials(study_id)}


def assert_untouched(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> None:
    """Nothing recorded of a study before changed after (it may have gone on training)."""
    assert set(before) <= set(after)
    finished = {"COMPLETE", "PRUNED", "FAIL"}
    for trial_id, was in before.items():
        now = after[trial_id]
        assert (now["number"], now["params"], now["distributions"]) == (was["number"], was["params"], was["distributions"])
        assert was["intermediate_values"].items() <= now["intermediate_values"].items(), trial_id
        if was["state"] in finished:
            assert now == was, trial_id
        else:
            assert now["error"] is None


def assert_completes_whole(client: Client, url: str, study: dict[str, Any], epochs: int) -> None:
    """The study completes, every trial with every epoch, and Optuna has the same."""
    done = client.wait(study["id"], timeout=TIMEOUT)
    assert done["state"] == "COMPLETE" and done["trial_counts"]["COMPLETE"] == study["n_trials"]
    trials = client.trials(study["id"])
    assert {t["state"] for t in trials} == {"COMPLETE"}
    assert all(sorted(map(int, t["intermediate_values"])) == list(range(epochs)) for t in trials)
    loaded = {t.number: t for t in optuna.load_study(study_name=study["name"], storage=url).trials}
    for t in trials:
        assert loaded[t["number"]].state == optuna.trial.TrialState.COMPLETE
        assert loaded[t["number"]].value == pytest.approx(t["value"])
        assert loaded[t["number"]].params == t["params"]


def two_studies_running(live: Service, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The other tenant's study trains on one worker, then ours on the other, both past an
    epoch; then the other's gets two more trials, which wait for a worker. Returns (ours, theirs).

    (The other's study starts with one trial: an array of one cannot be spread over both workers.)
    """
    theirs = sweep(live.other, f"{name}-theirs", n_trials=1, epochs=150)
    until(f"{name}-theirs to train", lambda: trained(live.other, theirs["id"]))
    ours = sweep(live.client, name, n_trials=8, epochs=LONG, pruner={"name": "MedianPruner", "kwargs": {"n_warmup_steps": 10_000}})
    until(f"{name} to train", lambda: trained(live.client, ours["id"]))
    theirs = live.other.update_study(theirs["id"], n_trials=3)  # more trials for a running study
    until(f"{name}-theirs to ask them", lambda: len(live.other.trials(theirs["id"])) == 3)
    return ours, theirs


def detail(exc: pytest.ExceptionInfo[FusetuneError]) -> tuple[int, list[Any]]:
    return exc.value.status_code, [d["loc"] for d in exc.value.detail]


def test_pause_stops_new_arrays_and_resume_finishes_the_study(live: Service, capsys: pytest.CaptureFixture[str]) -> None:
    client = live.client
    epochs = 80
    study = sweep(client, "paused", n_trials=10, epochs=epochs)
    running = until("the first epoch", lambda: trained(client, study["id"]))
    rest = ["--url", client.url, "--token", client.token]
    assert cli(["pause", str(study["id"]), *rest]) == 0
    assert "PAUSED" in capsys.readouterr().out
    assert client.pause_study(study["id"])["state"] == "PAUSED"  # again: no change

    # At the next epoch boundary the members leave, checkpointed, and wait; the arrays stop.
    def settled() -> list[dict[str, Any]] | None:
        trials = client.trials(study["id"])
        arrays = client.arrays(study["id"])
        quiet = all(t["state"] != "RUNNING" for t in trials) and all(a["state"] != "RUNNING" for a in arrays)
        return trials if quiet else None

    trials = until("the paused arrays to stop", settled)
    left = [t for t in trials if t["id"] in {r["id"] for r in running}]
    assert left and all(t["state"] == "WAITING" and t["intermediate_values"] and t["array_id"] is None for t in left)
    loaded = {t.number: t.state for t in optuna.load_study(study_name="paused", storage=live.url).trials}
    assert {loaded[t["number"]] for t in left} == {optuna.trial.TrialState.RUNNING}  # paused, not ended
    before, arrays = snapshot(client, study["id"]), client.arrays(study["id"])

    # Another study trains on the freed workers to the end; the paused one starts nothing meanwhile.
    other = sweep(client, "while-paused", n_trials=2, epochs=2)
    assert_completes_whole(client, live.url, other, 2)
    assert snapshot(client, study["id"]) == before
    assert client.arrays(study["id"]) == arrays
    assert client.study(study["id"])["state"] == "PAUSED"

    # More trials while paused; resuming runs them and resumes the paused ones where they left.
    assert client.update_study(study["id"], n_trials=11)["n_trials"] == 11
    assert cli(["resume", str(study["id"]), *rest]) == 0
    assert "RUNNING" in capsys.readouterr().out
    assert client.resume_study(study["id"])["state"] == "RUNNING"  # again: no change
    assert_completes_whole(client, live.url, {**study, "n_trials": 11}, epochs)
    resumed = {t.number: t.user_attrs.get("resumed_at_epochs") for t in optuna.load_study(study_name="paused", storage=live.url).trials}
    for t in left:  # from their checkpoints, not from scratch
        assert resumed[t["number"]] and all(0 < e < epochs for e in resumed[t["number"]])
    assert not list((live.artifacts / "paused" / "checkpoints").rglob("*.pt"))


def test_cancel_on_a_running_sweep_ends_every_trial_and_leaves_another_study_alone(live: Service) -> None:
    client = live.client
    ours, theirs = two_studies_running(live, "cancelled")
    with pytest.raises(FusetuneError) as refused:
        live.other.cancel_study(ours["id"])  # another tenant's study: as if it did not exist
    assert refused.value.status_code == 404
    before = snapshot(live.other, theirs["id"])
    asked = len(client.trials(ours["id"]))

    cancelled = client.cancel_study(ours["id"])
    assert cancelled["state"] == "CANCELLED"
    assert cancelled["trial_counts"]["WAITING"] == 0  # waiting trials end at once
    done = client.wait(ours["id"], timeout=TIMEOUT)  # ...running ones at their next epoch boundary
    assert done["state"] == "CANCELLED" and done["completed_at"] is not None
    assert client.cancel_study(ours["id"])["state"] == "CANCELLED"  # again: no change

    trials = client.trials(ours["id"])
    assert len(trials) == asked  # nothing asked since
    assert {t["state"] for t in trials} <= {"PRUNED", "FAIL"} and any(t["state"] == "PRUNED" for t in trials)
    for t in trials:
        assert t["error"].startswith("cancelled"), t
        if t["state"] == "PRUNED":  # trained, and stopped at an epoch boundary like a pruned trial
            steps = sorted(map(int, t["intermediate_values"]))
            assert steps == list(range(len(steps))) and t["value"] == t["intermediate_values"][str(steps[-1])]
        else:  # never trained
            assert not t["intermediate_values"]
    loaded = {t.number: t.state.name for t in optuna.load_study(study_name="cancelled", storage=live.url).trials}
    assert loaded == {t["number"]: t["state"] for t in trials}
    assert all(a["state"] != "RUNNING" for a in client.arrays(ours["id"]))
    assert not list((live.artifacts / "cancelled" / "checkpoints").rglob("*.pt"))
    # The event stream says the same: each trial's end, then the study's.
    stream = httpx.get(f"{client.url}/api/v1/studies/{ours['id']}/events", params={"after": 0, "follow": "false"},
                       headers={"Authorization": f"Bearer {client.token}"}, timeout=30)
    seen = events_of(stream.text)
    ended = {e["data"]["trial_id"]: e["data"]["data"] for e in seen if e["event"] == "trial.ended"}
    assert {i: (e["state"], e["error"]) for i, e in ended.items()} == {t["id"]: (t["state"], t["error"]) for t in trials}
    assert seen[-1]["event"] == "study.completed" and seen[-1]["data"]["data"]["state"] == "CANCELLED"

    assert_untouched(before, snapshot(live.other, theirs["id"]))
    assert_completes_whole(live.other, live.url, theirs, 150)
    assert_untouched(before, snapshot(live.other, theirs["id"]))
    with pytest.raises(FusetuneError) as refused:
        client.pause_study(ours["id"])
    assert detail(refused) == (409, [["study", "state"]])


def test_delete_on_a_running_sweep_removes_its_rows_optuna_study_and_artifacts(live: Service) -> None:
    client = live.client
    ours, theirs = two_studies_running(live, "deleted")
    folder = live.artifacts / "deleted"
    until("a checkpoint of the sweep", lambda: list((folder / "checkpoints").rglob("*.pt")))
    with pytest.raises(FusetuneError) as refused:
        live.other.delete_study(ours["id"])
    assert refused.value.status_code == 404
    before = snapshot(live.other, theirs["id"])
    optuna_id = optuna.load_study(study_name="deleted", storage=live.url)._study_id

    deleting = client.delete_study(ours["id"])  # its arrays still train: cancelled, then removed
    assert deleting is not None and deleting["state"] == "DELETING"

    def gone() -> bool:
        try:
            client.study(ours["id"])
        except FusetuneError as exc:
            return exc.status_code == 404
        return False

    until("the study to be gone", gone)  # hidden at once; its rows then go in batches, off the loop

    def removed() -> bool:
        with get_engine(live.url).connect() as conn:
            return conn.execute(sa.text("SELECT COUNT(*) FROM ft_studies WHERE id = :id"), {"id": ours["id"]}).scalar_one() == 0

    until("the study's rows to be removed", removed)
    with get_engine(live.url).connect() as conn:
        for table in ("ft_studies", "ft_trials", "ft_arrays"):
            column = "id" if table == "ft_studies" else "study_id"
            assert conn.execute(sa.text(f"SELECT COUNT(*) FROM {table} WHERE {column} = :id"), {"id": ours["id"]}).scalar_one() == 0
        assert conn.execute(sa.text("SELECT COUNT(*) FROM trials WHERE study_id = :id"), {"id": optuna_id}).scalar_one() == 0
        orphans = "SELECT COUNT(*) FROM ft_array_members m LEFT JOIN ft_trials t ON m.trial_id = t.id WHERE t.id IS NULL"
        assert conn.execute(sa.text(orphans)).scalar_one() == 0
    assert "deleted" not in optuna.get_all_study_names(storage=live.url)
    with pytest.raises(KeyError):
        optuna.load_study(study_name="deleted", storage=live.url)
    assert not folder.exists()
    assert [s["name"] for s in client.studies(name="deleted")] == []
    with pytest.raises(FusetuneError) as refused:
        client.delete_study(ours["id"])
    assert refused.value.status_code == 404

    assert_untouched(before, snapshot(live.other, theirs["id"]))
    assert_completes_whole(live.other, live.url, theirs, 150)
    # A study that runs no more is removed at once; its name is free again.
    assert live.other.delete_study(theirs["id"]) is None
    assert not (live.artifacts / theirs["name"]).exists()
    assert "deleted-theirs" not in optuna.get_all_study_names(storage=live.url)
    again = sweep(live.other, "deleted-theirs", n_trials=1, epochs=1)
    assert_completes_whole(live.other, live.url, again, 1)


def test_more_trials_run_and_bad_counts_or_quotas_are_refused_naming_the_field(live: Service) -> None:
    with Client(live.client.url, token=live.token_of("quota", max_trials_per_study=3, max_running_studies=1)) as client:
        small = sweep(client, "extended", n_trials=2, epochs=2)
        assert_completes_whole(client, live.url, small, 2)

        for body, loc in (({"n_trials": 0}, ["body", "n_trials"]), ({"n_trials": "many"}, ["body", "n_trials"]),
                          ({}, ["body", "n_trials"]), ({"n_trials": 3, "epochs": 9}, ["body", "epochs"])):
            with pytest.raises(FusetuneError) as refused:
                client._call("PATCH", f"/api/v1/studies/{small['id']}", json=body)
            assert detail(refused) == (422, [loc]), body
        with pytest.raises(FusetuneError) as refused:
            client.update_study(small["id"], n_trials=1)  # below the two asked
        assert detail(refused) == (409, [["body", "n_trials"]])
        with pytest.raises(FusetuneError) as refused:
            client.update_study(small["id"], n_trials=4)  # over max_trials_per_study
        assert detail(refused) == (422, [["body", "n_trials"]]) and "max_trials_per_study" in str(refused.value)
        for action in (client.pause_study, client.resume_study, client.cancel_study):  # it is COMPLETE
            with pytest.raises(FusetuneError) as refused:
                action(small["id"])
            assert detail(refused) == (409, [["study", "state"]])

        # A COMPLETE study given more trials runs again, within max_running_studies.
        long = sweep(client, "extended-long", n_trials=1, epochs=LONG)
        with pytest.raises(FusetuneError) as refused:
            client.update_study(small["id"], n_trials=3)
        assert detail(refused) == (409, [["tenant", "max_running_studies"]])
        assert client.study(small["id"])["state"] == "COMPLETE"
        assert client.pause_study(long["id"])["state"] == "PAUSED"  # a paused study does not run
        reopened = client.update_study(small["id"], n_trials=3)
        assert (reopened["state"], reopened["n_trials"], reopened["completed_at"]) == ("RUNNING", 3, None)
        with pytest.raises(FusetuneError) as refused:
            client.resume_study(long["id"])
        assert detail(refused) == (409, [["tenant", "max_running_studies"]])
        assert_completes_whole(client, live.url, {**small, "n_trials": 3}, 2)
        assert client.resume_study(long["id"])["state"] == "RUNNING"
        assert client.cancel_study(long["id"])["state"] == "CANCELLED"
        with pytest.raises(FusetuneError) as refused:
            client.update_study(long["id"], n_trials=2)
        assert detail(refused) == (409, [["study", "state"]])
        client.wait(long["id"], timeout=TIMEOUT)
        with pytest.raises(FusetuneError) as refused:  # another tenant's study: 404
            live.other.update_study(small["id"], n_trials=3)
        assert refused.value.status_code == 404


def test_a_study_whose_every_trial_fails_ends_failed(live: Service) -> None:
    study = live.client.create_study(
        "digits-mlp", n_trials=2, epochs=1, name="all-fail",
        search_space={"hidden": D.distribution_to_json(D.CategoricalDistribution([-1]))},
    )
    done = live.client.wait(study["id"], timeout=TIMEOUT)
    assert done["state"] == "FAILED" and done["trial_counts"]["FAIL"] == 2
    assert done["error"].startswith("every trial failed") and "negative dimension" in done["error"]
    with pytest.raises(FusetuneError) as refused:
        live.client.update_study(study["id"], n_trials=3)
    assert detail(refused) == (409, [["study", "state"]])


def test_a_client_driven_study_whose_workload_is_gone_fails_when_a_trial_is_enqueued(live: Service) -> None:
    """Its client enqueues the trials, so the loop never asks it: the enqueue finds the workload gone."""
    register_workload(dataclasses.replace(DIGITS_MLP, name="vanishing"))
    try:
        study = live.client.create_study("vanishing", n_trials=2, epochs=1, name="vanishing", driver="client")
    finally:
        _registered.pop("vanishing")
    with pytest.raises(FusetuneError) as refused:
        live.client.enqueue_trial(study["id"], {"lr": 0.1})
    assert detail(refused) == (409, [["study", "state"]])
    failed = live.client.study(study["id"])
    assert failed["state"] == "FAILED" and "'vanishing' cannot be loaded" in failed["error"]
    assert failed["completed_at"] is not None and live.client.trials(study["id"]) == []


def test_requests_waiting_for_the_loop_hold_no_database_connection(live: Service) -> None:
    """An enqueue waits for the loop's thread, which on SQLite draws on the requests' own
    connection pool (5 + 10 overflow). The test holds SQLite's write lock, so the loop blocks
    in its first write; 32 enqueues then wait for it at once. Each has read what it checks and
    given its connection back (32 checkouts, never more than a few at a time): before, each
    held one while it waited, 15 exhausted the pool, and the loop, once free, found none
    (503s after 30 s, every study stalled). Freed, the loop answers all 32."""
    import sqlite3
    from concurrent.futures import ThreadPoolExecutor

    from sqlalchemy import event

    if not live.url.startswith("sqlite"):
        pytest.skip("PostgreSQL: the loop's connections are a pool of their own (get_loop_sessionmaker)")
    study = live.client.create_study("digits-mlp", n_trials=32, epochs=1, name="flood", driver="client", search_space=ONE_SHAPE)
    engine = get_engine(live.url)
    checkouts: list[int] = []

    def checked_out(*_: Any) -> None:
        checkouts.append(engine.pool.checkedout())  # type: ignore[attr-defined]

    lock = sqlite3.connect(live.url.removeprefix("sqlite:///"), isolation_level=None)
    event.listen(engine, "checkout", checked_out)
    try:
        lock.execute("BEGIN IMMEDIATE")
        with ThreadPoolExecutor(32) as pool:
            enqueued = [pool.submit(live.client.enqueue_trial, study["id"], {"lr": 0.05 + i / 1000}) for i in range(32)]
            until("32 requests to have read and be waiting for the loop", lambda: len(checkouts) >= 33 and not any(f.done() for f in enqueued))
            lock.execute("ROLLBACK")
            trials = [f.result() for f in enqueued]
    finally:
        event.remove(engine, "checkout", checked_out)
        lock.close()
    assert max(checkouts) < 15
    assert sorted(t["number"] for t in trials) == list(range(32))
    with pytest.raises(FusetuneError) as full:  # its n_trials are all asked: the study's field, not the body's
        live.client.enqueue_trial(study["id"], {"lr": 0.1})
    assert detail(full) == (409, [["study", "n_trials"]])
    done = live.client.wait(study["id"], timeout=TIMEOUT)
    assert done["state"] == "COMPLETE" and done["trial_counts"]["COMPLETE"] == 32
