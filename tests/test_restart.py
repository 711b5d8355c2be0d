"""The whole service killed with -9 (server, scheduling loop and its local Ray), and a second
server on the same database that stands by, serves reads, and takes over when the first dies.

The service runs as ``fusetune serve`` in a process and session of its own (tests/faults.py),
with its own local Ray, so that ``kill -9`` takes all of it at once, as a crash would.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import httpx
import optuna
import pytest
import sqlalchemy as sa

from fusetune.client import Client
from tests.faults import ServiceProcess, audit, record, reported_steps, resumed, wait_until

pytestmark = pytest.mark.slow
D = optuna.distributions
ONE_SHAPE = {
    "hidden": D.distribution_to_json(D.CategoricalDistribution([32])),
    "lr": D.distribution_to_json(D.FloatDistribution(0.01, 0.1)),
}


def env_for(url: str, artifacts: Path) -> dict[str, str]:
    return {
        "FUSETUNE_DATABASE_URL": url,
        "FUSETUNE_ARTIFACT_DIR": str(artifacts),
        "FUSETUNE_CPU_WORKERS": "1",
        "FUSETUNE_MAX_ARRAY_SIZE": "4",
        "FUSETUNE_CHECKPOINT_INTERVAL_S": "0",
        "FUSETUNE_LEADER_POLL_S": "0.5",
        "FUSETUNE_LOG_LEVEL": "INFO",  # arrays' starts and ends: what a failed wait below prints
    }


def checkpoints(url: str, study_id: int) -> dict[int, int | None]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(sa.text("SELECT number, checkpoint_epoch FROM ft_trials WHERE study_id = :s"), {"s": study_id}).all())
    finally:
        engine.dispose()


def start_sweep(client: Client, url: str, name: str, epochs: int) -> tuple[int, dict[int, int]]:
    """A one-array study; returns its id once every member has reported its second checkpoint."""
    study = client.create_study(
        "digits-mlp", n_trials=4, epochs=epochs, name=name, search_space=ONE_SHAPE,
        sampler={"name": "RandomSampler", "kwargs": {"seed": 4}},
    )
    durable = wait_until(
        lambda: (c := checkpoints(url, study["id"])) and len(c) == 4 and all((e or 0) >= 2 for e in c.values()) and c,
        "every member's second checkpoint", 240,
    )
    return study["id"], durable


def check_resumed(url: str, name: str, epochs: int, durable: dict[int, int], stored: dict[int, int]) -> dict:
    result = audit(url, name, epochs)
    assert result["unfinished"] == [] and result["states"] == ["COMPLETE"]
    assert result["points_lost"] == 0 and result["points_duplicated"] == 0
    assert set(result["resumed_at_epochs"]) == set(durable)
    for number, (at,) in result["resumed_at_epochs"].items():
        # From its last reported checkpoint or a later one, never from scratch...
        assert 0 < durable[number] <= at
    # ...so at most the epochs since that checkpoint were trained again: those it had
    # reported past the checkpoint it resumed from.
    assert result["epochs_retrained"] == sum(stored[n] - at for n, (at,) in result["resumed_at_epochs"].items())
    assert result["epochs_retrained"] <= sum(stored[n] - durable[n] for n in durable)
    return result


def test_the_whole_service_killed_with_sigkill_resumes_from_checkpoints(tmp_path: Path) -> None:
    url, artifacts, epochs, name = f"sqlite:///{tmp_path / 'fusetune.db'}", tmp_path / "artifacts", 60, "kill9"
    admin = secrets.token_urlsafe(24)
    first = ServiceProcess(env_for(url, artifacts), tmp_path / "first.log", admin).start()
    second = ServiceProcess(env_for(url, artifacts), tmp_path / "second.log", admin)
    try:
        first.healthy()
        with Client(first.url, token=first.token()) as client:
            sid, durable = start_sweep(client, url, name, epochs)
        first.kill9()
        hit = time.monotonic()
        stored = reported_steps(url, name)  # what the dead service had written: final now
        assert all(stored[n] < epochs for n in durable), "the sweep ended before the kill"

        second.start().healthy()
        with Client(second.url, token=second.token()) as client:
            wait_until(lambda: resumed(client, sid, set(durable)), "the members to resume after the restart", 240,
                       explain=second.log_tail)
            recovered = time.monotonic() - hit
            done = client.wait(sid, timeout=300)
        assert done["trial_counts"].get("COMPLETE") == 4, done["trial_counts"]
        result = check_resumed(url, name, epochs, durable, stored)
        record(
            "whole service killed -9 and restarted", points_lost=0, points_duplicated=0,
            trials_failed=result["trials_failed"], epochs_retrained=result["epochs_retrained"], trials=4, epochs=epochs, recover_s=round(recovered, 2),
            resumed_at_epochs=result["resumed_at_epochs"], how="measured by tests/test_restart.py (includes the restart)",
        )
    finally:
        first.stop()
        second.stop()


def test_a_standby_server_serves_reads_and_takes_over_when_the_scheduler_dies(database_url: str, tmp_path: Path) -> None:
    """Two servers on one database: one scheduler (PostgreSQL advisory lock, SQLite file lock)."""
    url, artifacts, epochs = database_url, tmp_path / "artifacts", 60
    name = f"takeover-{make_backend(url)}"
    admin = secrets.token_urlsafe(24)
    leader = ServiceProcess(env_for(url, artifacts), tmp_path / "leader.log", admin).start()
    standby = ServiceProcess(env_for(url, artifacts), tmp_path / "standby.log", admin)
    try:
        leader.healthy()
        standby.start().healthy(workers=False)
        with Client(leader.url, token=leader.token()) as client:
            sid, durable = start_sweep(client, url, name, epochs)
        with Client(standby.url, token=standby.token()) as reader:
            assert httpx.get(f"{standby.url}/healthz").json()["workers"] == 0  # it does not schedule
            assert reader.study(sid)["name"] == name and len(reader.trials(sid)) == 4  # it serves reads
            assert len(reader.arrays(sid)) == 1  # only the leader started an array

            leader.kill9()
            hit = time.monotonic()
            stored = reported_steps(url, name)
            standby.healthy()  # it took the lock and started its workers
            wait_until(lambda: resumed(reader, sid, set(durable)), "the members to resume on the new scheduler", 240,
                       explain=standby.log_tail)
            recovered = time.monotonic() - hit
            done = reader.wait(sid, timeout=300)
        assert done["trial_counts"].get("COMPLETE") == 4, done["trial_counts"]
        result = check_resumed(url, name, epochs, durable, stored)
        record(
            f"scheduler killed -9, standby takes over ({make_backend(url)})", points_lost=0, points_duplicated=0,
            trials_failed=result["trials_failed"], epochs_retrained=result["epochs_retrained"], trials=4, epochs=epochs, recover_s=round(recovered, 2),
            resumed_at_epochs=result["resumed_at_epochs"], how="measured by tests/test_restart.py",
        )
    finally:
        leader.stop()
        standby.stop()


def make_backend(url: str) -> str:
    return sa.engine.make_url(url).get_backend_name()


def test_sigterm_shuts_the_service_down_gracefully_mid_sweep(tmp_path: Path) -> None:
    """``docker stop`` sends SIGTERM to the server: uvicorn's graceful shutdown runs (the
    lifespan stops the scheduling loop and the pool), not Ray's handler, which would raise
    SystemExit inside the event loop."""
    url, artifacts = f"sqlite:///{tmp_path / 'fusetune.db'}", tmp_path / "artifacts"
    service = ServiceProcess(env_for(url, artifacts), tmp_path / "serve.log", secrets.token_urlsafe(24)).start()
    try:
        service.healthy()
        with Client(service.url, token=service.token()) as client:
            start_sweep(client, url, "sigterm", epochs=60)  # an array is training
        assert service.proc is not None
        service.proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM.
        assert service.proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = (tmp_path / "serve.log").read_text(errors="replace")
        assert "Application shutdown complete." in log
        assert "SystemExit" not in log and "Traceback" not in log
    finally:
        service.stop()


def test_a_scheduler_whose_lock_session_is_killed_is_fenced_and_the_standby_resumes_once(tmp_path: Path) -> None:
    """PostgreSQL: the leader's lock session is killed (pg_terminate_backend) while the leader
    lives on and, polling its lock only hourly, keeps scheduling. The standby takes the lock
    and a newer fencing epoch, and re-queues the leader's array; from then on the database
    refuses every commit of the old leader (server/fencing.py), which steps down. No write
    of it lands after the takeover: every trial resumed once, no step is stored twice."""
    from tests.conftest import _postgres_database

    generator = _postgres_database()
    url = next(generator)
    artifacts, epochs, name = tmp_path / "artifacts", 60, "fenced"
    admin = secrets.token_urlsafe(24)
    # The old leader never looks at its lock again: only the fence can stop it. Its worker is
    # frozen below while the standby takes over, so it must not be taken for hung meanwhile.
    leader = ServiceProcess(
        {**env_for(url, artifacts), "FUSETUNE_LEADER_POLL_S": "3600", "FUSETUNE_HEARTBEAT_TIMEOUT_S": "3600"},
        tmp_path / "leader.log", admin,
    ).start()
    standby = ServiceProcess(env_for(url, artifacts), tmp_path / "standby.log", admin)
    frozen: int | None = None
    try:
        leader.healthy()
        standby.start().healthy(workers=False)
        with Client(leader.url, token=leader.token()) as client:
            sid, durable = start_sweep(client, url, name, epochs)
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                # The leader's worker is frozen (SIGSTOP) until the standby holds the new epoch,
                # so the old leader still has epochs to report then, however fast this machine
                # trains: its first report after SIGCONT is a commit the fence must refuse.
                node = conn.execute(sa.text(
                    "SELECT w.node FROM ft_arrays a JOIN ft_workers w ON w.id = a.worker_id"
                    " WHERE a.study_id = :s AND a.state = 'RUNNING'"
                ), {"s": sid}).scalar_one()
                frozen = int(node.rsplit(":", 1)[1])
                os.kill(frozen, signal.SIGSTOP)
                stored = reported_steps(url, name)
                assert all(stored[n] < epochs for n in durable), "the sweep ended before the worker was frozen"
                epoch_before = conn.execute(sa.text("SELECT epoch FROM ft_scheduler")).scalar_one()
                killed = conn.execute(sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                )).scalars().all()
            assert killed == [True], killed  # the leader's one lock session
            hit = time.monotonic()
            with Client(standby.url, token=standby.token()) as reader:
                standby.healthy()  # it took the lock, a new epoch, and started its workers
                with engine.connect() as conn:
                    assert conn.execute(sa.text("SELECT epoch FROM ft_scheduler")).scalar_one() == epoch_before + 1
                os.kill(frozen, signal.SIGCONT)
                wait_until(lambda: "another server schedules on this database now" in leader.log_path.read_text(errors="replace"),
                           "the old leader to be refused by the fence", 240, explain=leader.log_tail)
                wait_until(lambda: resumed(reader, sid, set(durable)), "the members to resume on the new scheduler", 240,
                           explain=standby.log_tail)
                recovered = time.monotonic() - hit
                done = reader.wait(sid, timeout=300)
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT epoch FROM ft_scheduler")).scalar_one() == epoch_before + 1
        finally:
            engine.dispose()
        assert leader.proc is not None and leader.proc.poll() is None  # the old leader lives on, as a standby
        assert httpx.get(f"{leader.url}/healthz").json()["workers"] == 0
        assert done["trial_counts"].get("COMPLETE") == 4, done["trial_counts"]
        result = audit(url, name, epochs)
        assert result["unfinished"] == [] and result["states"] == ["COMPLETE"]
        assert result["points_lost"] == 0 and result["points_duplicated"] == 0
        # Resumed once each, by the standby, from a checkpoint the old leader had recorded.
        assert set(result["resumed_at_epochs"]) == set(durable)
        assert all(len(at) == 1 and at[0] >= durable[n] for n, at in result["resumed_at_epochs"].items()), result
        record(
            "scheduler lock session killed, old leader alive (postgresql)", points_lost=0, points_duplicated=0,
            trials_failed=result["trials_failed"], epochs_retrained=result["epochs_retrained"], trials=4, epochs=epochs, recover_s=round(recovered, 2),
            resumed_at_epochs=result["resumed_at_epochs"], stale_writes_landed=0,
            how="measured by tests/test_restart.py (the stale leader refused by the fencing row)",
        )
    finally:
        if frozen is not None:  # a failure above may have left it frozen
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        leader.stop()
        standby.stop()
        generator.close()
