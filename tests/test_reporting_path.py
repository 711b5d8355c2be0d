"""The path from a training worker to the database: through the control plane, once per array-epoch.

Workers never touch the database: each array-epoch is one message to the control plane,
which writes it in one transaction (every member's intermediate value, fusetune's rows, the
measured throughput) and replies with the pruning decisions. What real arrays measured is
persisted, so a restarted service sizes arrays from it instead of measuring again.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
import pytest
from sqlalchemy import Engine, event, select

from fusetune.scheduler import fit_points
from fusetune.server import service
from fusetune.server.db import Array, Study, StudyState, Throughput, get_optuna_storage, get_sessionmaker, upgrade
from fusetune.server.loop import SchedulingLoop
from fusetune.server.schemas import StudyCreate
from fusetune.server.settings import Settings
from fusetune.workers.pool import WorkerPool
from fusetune.workers.spec import EpochReport

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
ONE_SHAPE = {"hidden": optuna.distributions.distribution_to_json(optuna.distributions.CategoricalDistribution([32]))}


class WriteTransactions:
    """Counts committed transactions that wrote, on every engine (ours and Optuna's)."""

    def __init__(self) -> None:
        self.committed: list[set[str]] = []  # per transaction: the tables it wrote

    def _execute(self, conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        words = statement.split()
        verb = words[0].upper() if words else ""
        if verb not in ("INSERT", "UPDATE", "DELETE"):
            return
        table = words[2] if verb in ("INSERT", "DELETE") else words[1]
        conn.info.setdefault("fusetune_writes", set()).add(table.strip('"'))

    def _commit(self, conn) -> None:  # noqa: ANN001
        writes = conn.info.pop("fusetune_writes", None)
        if writes:
            self.committed.append(writes)

    def _rollback(self, conn) -> None:  # noqa: ANN001
        conn.info.pop("fusetune_writes", None)

    @contextmanager
    def counting(self) -> Iterator[WriteTransactions]:
        hooks = [("before_cursor_execute", self._execute), ("commit", self._commit), ("rollback", self._rollback)]
        for name, fn in hooks:
            event.listen(Engine, name, fn)
        try:
            yield self
        finally:
            for name, fn in hooks:
                event.remove(Engine, name, fn)


def _step_until(coordinator: SchedulingLoop, done, what: str, timeout: float = 180) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        coordinator.step()
        coordinator.handle(coordinator.pool.wait(0.5))  # the loop thread's wait for the next report


def _study_state(url: str, name: str) -> StudyState:
    with get_sessionmaker(url)() as session:
        return session.scalar(select(Study.state).where(Study.name == name))


def test_each_array_epoch_is_one_transaction_with_every_members_value(ray_cluster: str, database_url: str, tmp_path: Path) -> None:
    settings = Settings(database_url=database_url, ray_address=ray_cluster, cpu_workers=1, max_array_size=4,
                        artifact_dir=tmp_path, checkpoint_interval_s=0)
    upgrade(database_url)
    get_optuna_storage(database_url)
    epochs = 3
    with get_sessionmaker(database_url)() as session:
        service.create_study(session, database_url, StudyCreate(workload="digits-mlp", n_trials=4, epochs=epochs,
                                                                 name="txn", search_space=ONE_SHAPE))
    pool = WorkerPool(cpu_workers=1, name_prefix="txn")
    try:
        coordinator = SchedulingLoop(settings, pool)
        coordinator.setup()
        coordinator.step()  # asks the 4 trials and starts their array
        assert not pool.idle(), "the array did not start"
        with WriteTransactions().counting() as writes:
            # The study completes with its last epoch; the array's end is recorded as its outcome comes.
            _step_until(coordinator, lambda: _study_state(database_url, "txn") == StudyState.COMPLETE and pool.idle(), "the study")
    finally:
        pool.shutdown()

    with get_sessionmaker(database_url)() as session:
        assert [(a.size, a.epochs_done) for a in session.scalars(select(Array))] == [(4, epochs)]
    # One transaction per array-epoch wrote intermediate values, fusetune's array row and the
    # measured throughput; the last one also ended the study. Nothing else wrote while the
    # array trained but its end.
    epoch_transactions = [w for w in writes.committed if "ft_arrays" in w and "ft_throughput" in w]
    assert len(epoch_transactions) == epochs, writes.committed
    assert ["ft_studies" in w for w in epoch_transactions] == [False] * (epochs - 1) + [True], writes.committed
    if not database_url.startswith("postgresql"):
        # (PostgreSQL takes the values by COPY, which goes around SQLAlchemy's cursor hooks.)
        assert all("trial_intermediate_values" in w and "ft_events" in w for w in epoch_transactions), writes.committed
    assert len(writes.committed) == epochs + 1, writes.committed
    # ...and those few transactions hold every member's value of every epoch.
    study = optuna.load_study(study_name="txn", storage=database_url)
    assert {t.state for t in study.trials} == {optuna.trial.TrialState.COMPLETE}
    assert [sorted(t.intermediate_values) for t in study.trials] == [list(range(epochs))] * 4


def _reports_of_both_arrays(pool: WorkerPool, timeout: float = 180) -> list:
    """Wait until both busy workers have reported (each then waits for its reply)."""
    events: list = []
    deadline = time.monotonic() + timeout
    while len(events) < 2:
        assert time.monotonic() < deadline, f"only {events} reported"
        events += pool.wait(1.0)
    assert all(isinstance(item, EpochReport) for _, _, item in events)
    return events


def test_reports_that_arrive_together_are_written_together_and_a_bad_one_costs_only_itself(
    ray_cluster: str, database_url: str, tmp_path: Path
) -> None:
    settings = Settings(database_url=database_url, ray_address=ray_cluster, cpu_workers=2, max_array_size=2,
                        artifact_dir=tmp_path, checkpoint_interval_s=0)
    upgrade(database_url)
    get_optuna_storage(database_url)
    with get_sessionmaker(database_url)() as session:
        # With a pruner, a worker waits for each report's reply: one report per worker at a time.
        service.create_study(session, database_url, StudyCreate(
            workload="digits-mlp", n_trials=4, epochs=3, name="together", search_space=ONE_SHAPE,
            pruner={"name": "MedianPruner", "kwargs": {"n_startup_trials": 100}},
        ))
    pool = WorkerPool(cpu_workers=2, name_prefix="together")
    try:
        coordinator = SchedulingLoop(settings, pool)
        coordinator.setup()
        coordinator.step()  # two arrays of two, one per worker
        assert pool.idle() == [], "both arrays should have started"

        def arrays() -> dict[int, int]:
            with get_sessionmaker(database_url)() as session:
                return {a.id: a.epochs_done for a in session.scalars(select(Array))}

        # Both arrays' first reports reach the loop in one wait: one transaction writes them.
        first = _reports_of_both_arrays(pool)
        with WriteTransactions().counting() as writes:
            coordinator.handle(first)
        assert len([w for w in writes.committed if "ft_arrays" in w]) == 1, writes.committed
        assert sorted(arrays().values()) == [1, 1]

        # The next ones, with a report of an array the control plane never started among them:
        # the batch rolls back, then each is written alone; the bad one is dropped, and only it.
        second = _reports_of_both_arrays(pool)
        worker, spec, report = second[0]
        stray = (worker, spec, dataclasses.replace(report, array_id=10**6))
        with WriteTransactions().counting() as writes:
            coordinator.handle([second[0], stray, second[1]])
        assert len([w for w in writes.committed if "ft_arrays" in w]) == 2, writes.committed
        assert sorted(arrays().values()) == [2, 2]

        _step_until(coordinator, lambda: _study_state(database_url, "together") == StudyState.COMPLETE, "the study")
    finally:
        pool.shutdown()
    study = optuna.load_study(study_name="together", storage=database_url)
    assert [sorted(t.intermediate_values) for t in study.trials] == [[0, 1, 2]] * 4


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_workers_import_nothing_from_the_server() -> None:
    files = sorted((ROOT / "workers").rglob("*.py"))
    assert files
    for path in files:
        bad = {n for n in _imports(path) if n.split(".")[0] == "server" or n.startswith("fusetune.server")}
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    # Also at run time: loading the worker actor pulls in no server module.
    code = (
        "import sys, fusetune.workers.actor, fusetune.workers.pool; "
        "print(sorted(m for m in sys.modules if m.startswith('fusetune.server') or m.split('.')[0] == 'server'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_restarted_service_sizes_arrays_from_what_earlier_arrays_measured(ray_cluster: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fusetune.db'}"
    settings = Settings(database_url=url, ray_address=ray_cluster, cpu_workers=1, max_array_size=4, artifact_dir=tmp_path)
    upgrade(url)
    get_optuna_storage(url)
    sessions = get_sessionmaker(url)

    def submit(name: str, epochs: int) -> None:
        with sessions() as session:
            service.create_study(session, url, StudyCreate(workload="digits-mlp", n_trials=4, epochs=epochs, name=name,
                                                           search_space=ONE_SHAPE))

    pool = WorkerPool(cpu_workers=1, name_prefix="restart")
    try:
        first = SchedulingLoop(settings, pool)
        first.setup()
        submit("before", epochs=2)
        first.step()
        assert pool.workers[0].spec.probe_solo, "a new class's first array measures its unfused speed"
        # The study completes with its trials' last reports; the array's stream ends after
        # them: the worker is idle, and free for the next array, only then.
        _step_until(first, lambda: _study_state(url, "before") == StudyState.COMPLETE and pool.workers[0].idle,
                    "the first study and its array")
        with sessions() as session:
            measured = {t.members: t.models_steps_per_s for t in session.scalars(select(Throughput))}
        assert set(measured) == {1, 4}

        # A new process on the same database: the same shapes are known, nothing is measured
        # again, though this study trains for other epochs.
        second = SchedulingLoop(settings, pool)
        second.setup()
        submit("after", epochs=3)
        second.step()
        spec = pool.workers[0].spec
        assert spec is not None and not spec.probe_solo
        curve = second.scheduler.throughput.curve(spec.signature, "cpu")
        assert curve == fit_points(measured, settings.prior_marginal_cost)
        _step_until(second, lambda: _study_state(url, "after") == StudyState.COMPLETE, "the second study")
        with sessions() as session:
            after = [a.timings or {} for a in session.scalars(select(Array).join(Study).where(Study.name == "after"))]
        assert after and all("probe_s" not in timings for timings in after)
    finally:
        pool.shutdown()
