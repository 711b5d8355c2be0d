"""The simulator on a hand-written mini-trace: the call a live run is compared with.

Three tenants, thirty studies, two device types (the shape of the live two-node test of
issue 32).  Everything is plain data: the studies and trials, one speed-up curve per
(job type, device type), device counts and memory.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fusetune.scheduler import SpeedupCurve
from fusetune.scheduler._simulator import simulate
from fusetune.scheduler._trace import TraceStudy, TraceTrial

GIB = 1 << 30
CURVES = {
    ("mlp", "fast"): SpeedupCurve(4.0, 0.3),
    ("mlp", "slow"): SpeedupCurve(2.0, 0.6),
    ("cnn", "fast"): SpeedupCurve(3.0, 0.2),
    ("cnn", "slow"): SpeedupCurve(0.5, 1.0),
}


def mini_trace() -> tuple[list[TraceStudy], list[TraceTrial]]:
    """30 studies of 2-4 trials from tenants a, b, c arriving over ten minutes."""
    studies: list[TraceStudy] = []
    trials: list[TraceTrial] = []
    for sid in range(30):
        tenant = "abc"[sid % 3]
        job = "cnn" if tenant == "b" else "mlp"
        ids = []
        for k in range(2 + sid % 3):
            ids.append(len(trials))
            trials.append(TraceTrial(len(trials), sid, tenant, job, 20.0 * sid, 200.0 * (1 + k % 2)))
        studies.append(TraceStudy(sid, tenant, job, 20.0 * sid, tuple(ids)))
    return studies, trials


@pytest.mark.parametrize("policy", ["fifo", "gavel", "fusetune"])
def test_mini_trace_replays_deterministically_with_shares_and_jcts(policy: str) -> None:
    studies, trials = mini_trace()
    kwargs = {"round_seconds": 30.0, "max_members": 4, "memory": {"fast": 16 * GIB, "slow": 16 * GIB}}
    first = simulate(policy, studies, trials, CURVES, {"fast": 1, "slow": 1}, **kwargs)  # type: ignore[arg-type]
    again = simulate(policy, studies, trials, CURVES, {"fast": 1, "slow": 1}, **kwargs)  # type: ignore[arg-type]
    # Identical but for the solver's wall time, the one measured quantity.
    assert replace(first, solver_ms_mean=0.0, solver_ms_max=0.0) == replace(again, solver_ms_mean=0.0, solver_ms_max=0.0)
    assert set(first.jct_by_study) == {s.study_id for s in studies}
    assert all(j > 0 for j in first.jct_by_study.values())
    assert set(first.device_share) == {"a", "b", "c"}
    assert sum(first.device_share.values()) == pytest.approx(1.0)
    assert first.avg_jct_h == pytest.approx(sum(first.jct_by_study.values()) / 30 / 3600.0)


def test_fusion_and_fairness_finish_the_mini_trace_sooner_than_fifo() -> None:
    studies, trials = mini_trace()
    kwargs = {"round_seconds": 30.0, "max_members": 4, "memory": {"fast": 16 * GIB, "slow": 16 * GIB}}
    fifo = simulate("fifo", studies, trials, CURVES, {"fast": 1, "slow": 1}, **kwargs)  # type: ignore[arg-type]
    fusetune = simulate("fusetune", studies, trials, CURVES, {"fast": 1, "slow": 1}, **kwargs)  # type: ignore[arg-type]
    assert fusetune.avg_jct_h < fifo.avg_jct_h
    assert fusetune.makespan_h < fifo.makespan_h


@pytest.mark.parametrize("policy", ["gavel", "fusetune"])
def test_a_preemption_waits_for_the_members_epoch_boundary_when_trials_have_epochs(policy: str) -> None:
    """One device; tenant A's long trial (epochs of 10 steps, 1 step/s) runs when tenant B's
    short one arrives at t = 1, and leases expire at once. Without epochs the simulator
    shares the device from the next round; with them A's array goes on to its boundary at
    t = 10, as a live array does, and only then does B's trial start (4 steps: done at 14)."""
    curves = {("x", "d"): SpeedupCurve(1.0, 1.0), ("y", "d"): SpeedupCurve(1.0, 1.0)}
    studies = [TraceStudy(0, "A", "x", 0.0, (0,)), TraceStudy(1, "B", "y", 1.0, (1,))]

    def b_jct(epoch_steps: float) -> float:
        trials = [TraceTrial(0, 0, "A", "x", 0.0, 40.0, epoch_steps), TraceTrial(1, 1, "B", "y", 1.0, 4.0, epoch_steps)]
        result = simulate(policy, studies, trials, curves, {"d": 1}, {"d": GIB}, round_seconds=1.0, lease_seconds=0.0, seed=None)
        return result.jct_by_study[1]

    assert b_jct(0.0) < 9.0  # B shares the device before A's first epoch would end
    assert b_jct(10.0) == pytest.approx(10.0 - 1.0 + 4.0)
