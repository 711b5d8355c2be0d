"""``benchmarks/api.py --delete``: deleting a study of 100,000 trials x 20 epochs while another
study's array reports, on PostgreSQL (issue 29, item 3).

The scheduling loop is played by this process's main thread, as ``benchmarks/api.py``'s
ingestion plays it: it records the neighbour's array-epochs through the coordinator's own
``_record_epochs`` (real ``EpochReport`` objects, one every ``--report-interval`` s), runs
the loop's inbox between them, and takes the delete as the loop takes it
(``SchedulingLoop.delete``: the study hidden in one short transaction, its rows then removed by
the purger's thread in batches of ``FUSETUNE_DELETE_BATCH_TRIALS`` trials). Measured: the
delete's turn of the loop, the purge's length and rate, and each neighbour array-epoch's
recording time and the gap between two of them, quiet and while the purge runs. For
comparison, a second study of the same size is removed as it was before (Optuna's ORM
cascade, ``session.delete(study)``, in one transaction on the loop's thread): every gap of
the neighbour then includes it.

Nothing asserts a speed: the table says what was measured.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from typing import Any

from benchmarks._bigstudy import create_studies, percentile, scratch_database, seed_trials, vacuum

#: The scheduling loop's round: a neighbour's epoch delayed by no more than this waited one round at most.
ROUND_S = 0.2


def _series(ms: list[float]) -> dict[str, float]:
    return {"n": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": max(ms, default=float("nan"))}


def _seed(url: str, args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    from benchmarks.api import arrays_of

    studies = create_studies(url, ["doomed", "doomed-by-cascade", "neighbour"], 100_000)
    started = time.perf_counter()
    from fusetune.server.db import get_engine

    with get_engine(url).begin() as conn:
        seed_trials(conn, studies["doomed"], args.trials, args.delete_steps, waiting=0, state_of_rest="COMPLETE")
        # The way before is timed on a smaller study: at 100,000 trials it takes many minutes.
        seed_trials(conn, studies["doomed-by-cascade"], args.cascade_trials, args.delete_steps, waiting=0, state_of_rest="COMPLETE")
        seed_trials(conn, studies["neighbour"], args.array_size, 0, waiting=args.array_size, state_of_rest="RUNNING")
    vacuum(url)
    print(f"seeded {args.trials} + {args.cascade_trials} trials x {args.delete_steps} values in {time.perf_counter() - started:.1f} s", flush=True)
    studies["neighbour-array"] = arrays_of(url, studies["neighbour"][0], args.array_size, 1, start=True)[0]  # type: ignore[assignment]
    return studies


def _rows_left(url: str, study_id: int) -> bool:
    from sqlalchemy import text

    from fusetune.server.db import get_engine

    with get_engine(url).connect() as conn:
        return bool(conn.execute(text("SELECT count(*) FROM ft_studies WHERE id = :s"), {"s": study_id}).scalar_one())


def _neighbour_until(recorder: Any, array_id: int, interval: float, done: Any, before: Any = None) -> tuple[list[float], list[float]]:
    """Record the neighbour's array-epochs every ``interval`` s until ``done()``; ``before()``
    runs on this thread first (the delete, taken in a turn of the loop). Returns each
    epoch's recording time and the gaps between two recorded epochs, in ms."""
    record_ms, gaps_ms, last = [], [], time.perf_counter()
    if before is not None:
        before()
    while True:  # at least one epoch after ``before``: its gap includes it
        recorder.coordinator.thread.run_inbox()  # what the purger handed back (the study's own rows)
        started = time.perf_counter()
        recorder.record(recorder.report(array_id))
        now = time.perf_counter()
        record_ms.append((now - started) * 1000)
        gaps_ms.append((now - last) * 1000)
        last = now
        if done():
            return record_ms, gaps_ms
        time.sleep(max(0.0, interval - (time.perf_counter() - started)))


def delete_scenario(args: argparse.Namespace) -> dict[str, Any]:
    from sqlalchemy import select

    from benchmarks.api import Recorder
    from fusetune.server.db import Study, StudyState, get_sessionmaker
    from fusetune.server.purge import StudyPurger

    results: dict[str, Any] = {"trials": args.trials, "steps": args.delete_steps}
    with scratch_database(args.base_url, "fusetune_delete") as url:
        studies = _seed(url, args)
        (neighbour, _), (array_id, members) = studies["neighbour"], studies["neighbour-array"]  # type: ignore[misc]
        recorder = Recorder(url, {neighbour: "neighbour"})
        recorder.add_array(neighbour, "neighbour", array_id, members)
        coordinator = recorder.coordinator
        coordinator.ctx.purger = StudyPurger(
            coordinator.ctx.sessions, tempfile.mkdtemp(prefix="fusetune-delete-"), coordinator.settings.delete_batch_trials,
            finish=lambda purge: coordinator.post(lambda: coordinator.lifecycle.finish_delete(purge)),
        )
        interval = args.neighbour_interval
        # As the server does once it is up (server/app.py): what it holds by now is frozen, out
        # of the collector's full passes. Unfrozen here, one such pass (180 ms) landed on the
        # purge's first seconds and was counted as the purge's stall of the neighbour.
        gc.collect()
        gc.freeze()
        quiet = _neighbour_until(recorder, array_id, interval, _deadline(args.duration / 3))
        doomed = studies["doomed"][0]
        with get_sessionmaker(url).begin() as session:  # its arrays have stopped: nothing runs
            session.get(Study, doomed).state = StudyState.DELETING
        turn: dict[str, float] = {}
        purge_started = time.perf_counter()

        def delete_in_a_turn() -> None:
            started = time.perf_counter()
            coordinator.lifecycle.delete(doomed)
            turn["s"] = time.perf_counter() - started

        during = _neighbour_until(recorder, array_id, interval, lambda: not _rows_left(url, doomed), delete_in_a_turn)
        purge_s = time.perf_counter() - purge_started
        results["delete: the loop's turn (hide, hand to the purger)"] = turn["s"] * 1000
        results["delete: until every row is gone"] = purge_s
        results["delete: rows of the study"] = args.trials * (args.delete_steps + 6)
        results["neighbour record, quiet"] = _series(quiet[0])
        results["neighbour record, during the purge"] = _series(during[0])
        results["neighbour gap, quiet"] = _series(quiet[1][1:])
        results["neighbour gap, during the purge"] = _series(during[1])

        cascade = studies["doomed-by-cascade"]

        def cascade_in_a_turn() -> None:  # the way before: Optuna's ORM cascade on the loop's thread
            from optuna.storages._rdb import models as rdb

            started = time.perf_counter()
            with get_sessionmaker(url).begin() as session:
                session.delete(session.get(rdb.StudyModel, cascade[1]))
                session.execute(select(Study).where(Study.id == cascade[0]))
            turn["cascade"] = time.perf_counter() - started

        cascaded = _neighbour_until(recorder, array_id, interval, _deadline(1.0), cascade_in_a_turn)
        results["before: Optuna's cascade in one transaction"] = turn["cascade"]
        results["cascade trials"] = args.cascade_trials
        results["neighbour gap, with the cascade"] = _series(cascaded[1])
    return results


def _deadline(seconds: float) -> Any:
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end


def delete_table(results: dict[str, Any]) -> str:
    lines = [f"study deleted: {results['trials']:,} trials x {results['steps']} epochs (~{results['delete: rows of the study']:,} rows)"]
    lines.append(f"  the loop's turn that deletes it (hidden at once): {results['delete: the loop' + chr(39) + 's turn (hide, hand to the purger)']:.1f} ms")
    lines.append(f"  every row gone, on the purger's thread:           {results['delete: until every row is gone']:.1f} s")
    lines.append(f"  before, Optuna's ORM cascade on the loop's thread: {results['before: Optuna' + chr(39) + 's cascade in one transaction']:.1f} s "
                 f"for {results['cascade trials']:,} trials (the loop stalled that long)")
    lines.append(f"{'neighbour array-epoch (ms)':<44} {'n':>6} {'p50':>8} {'p99':>8} {'max':>8}")
    for key in ("neighbour record, quiet", "neighbour record, during the purge", "neighbour gap, quiet",
                "neighbour gap, during the purge", "neighbour gap, with the cascade"):
        s = results[key]
        lines.append(f"{key:<44} {s['n']:>6} {s['p50']:>8.1f} {s['p99']:>8.1f} {s['max']:>8.1f}")
    worst = results["neighbour gap, during the purge"]["max"] - results["neighbour gap, quiet"]["max"]
    lines.append(f"worst extra wait of a neighbour's epoch during the purge: {worst:.0f} ms "
                 f"(one scheduling round is {ROUND_S * 1000:.0f} ms: {'within' if worst <= ROUND_S * 1000 else 'NOT within'})")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run it as: python benchmarks/api.py --delete")
