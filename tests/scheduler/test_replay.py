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


def test_as_the_live_loop_nothing_is_decided_while_no_trial_waits() -> None:
    """Tenant B's short trial takes the fast device and A's long one the slow device (4x
    slower); B's ends at t = 2. Deciding every round, as Gavel's simulator does, the scheduler
    moves A's trial to the fast device then; the live loop decides only when a trial waits,
    so A's trial stays where it started (``live_loop=True``)."""
    curves = {(j, g): SpeedupCurve(4.0 if g == "fast" else 1.0, 1.0) for j in "xy" for g in ("fast", "slow")}
    studies = [TraceStudy(0, "B", "y", 0.0, (0,)), TraceStudy(1, "A", "x", 0.0, (1,))]
    trials = [TraceTrial(0, 0, "B", "y", 0.0, 8.0), TraceTrial(1, 1, "A", "x", 0.0, 40.0)]

    def a_jct(live_loop: bool) -> float:
        result = simulate(
            "fusetune", studies, trials, curves, {"fast": 1, "slow": 1}, {"fast": GIB, "slow": GIB},
            round_seconds=1.0, lease_seconds=0.0, seed=None, live_loop=live_loop,
        )
        assert result.jct_by_study[0] == pytest.approx(2.0)
        return result.jct_by_study[1]

    assert a_jct(False) == pytest.approx(2.0 + (40.0 - 2.0) / 4.0)
    assert a_jct(True) == pytest.approx(40.0)


@pytest.mark.parametrize("policy", ["gavel", "fusetune"])
def test_as_the_live_loop_a_device_goes_on_with_its_studys_next_trial(policy: str) -> None:
    """One device; tenant A's study 0 has two trials of 4 s, its study 1 one, arriving at
    t = 0.5. When study 0's first trial ends, the scheduler (max-min within the tenant) gives
    the device to study 1; the live loop's chain keeps it for study 0's next trial, so study
    0 ends at 8 s and study 1 after it."""
    curves = {("x", "d"): SpeedupCurve(1.0, 1.0), ("z", "d"): SpeedupCurve(1.0, 1.0)}
    studies = [TraceStudy(0, "A", "x", 0.0, (0, 1)), TraceStudy(1, "A", "z", 0.5, (2,))]
    trials = [TraceTrial(0, 0, "A", "x", 0.0, 4.0), TraceTrial(1, 0, "A", "x", 0.0, 4.0), TraceTrial(2, 1, "A", "z", 0.5, 4.0)]

    def jcts(live_loop: bool) -> dict[int, float]:
        result = simulate(
            policy, studies, trials, curves, {"d": 1}, {"d": GIB}, round_seconds=1.0, lease_seconds=0.0, seed=None,
            max_members=1, live_loop=live_loop,
        )
        return dict(result.jct_by_study)

    assert jcts(False) == pytest.approx({0: 12.0, 1: 7.5})
    assert jcts(True) == pytest.approx({0: 8.0, 1: 11.5})


def test_as_the_live_loop_a_studys_trials_arrive_a_group_per_idle_device() -> None:
    """Two devices, one busy with tenant A's long trial, when tenant B's study of two trials
    (5-step epochs, fusing almost free) arrives at t = 1. With both trials there, one array of
    two trains them together from t = 1. The live loop asks one group per idle device (one
    trial: groups are spread so that a batch fills both devices), places it, and asks the other
    a round later, which joins that array at its first epoch boundary, t = 6."""
    curves = {("x", "d"): SpeedupCurve(1.0, 0.1), ("y", "d"): SpeedupCurve(1.0, 0.1)}
    studies = [TraceStudy(0, "A", "x", 0.0, (0,)), TraceStudy(1, "B", "y", 1.0, (1, 2))]
    trials = [
        TraceTrial(0, 0, "A", "x", 0.0, 100.0, 10.0), TraceTrial(1, 1, "B", "y", 1.0, 10.0, 5.0),
        TraceTrial(2, 1, "B", "y", 1.0, 10.0, 5.0),
    ]

    def b_jct(live_loop: bool) -> float:
        result = simulate(
            "fusetune", studies, trials, curves, {"d": 2}, {"d": GIB}, round_seconds=1.0, lease_seconds=100.0, seed=None,
            max_members=4, live_loop=live_loop,
        )
        return result.jct_by_study[1]

    pair = curves[("y", "d")].rate(2) / 2  # steps/s of each member of an array of two: 1 / 1.1
    assert b_jct(False) == pytest.approx(10.0 / pair)
    # The second trial joins at t = 6. Its partner ends mid-round (t = 11.5), so it trains in
    # the pair until the round at t = 12, then alone at 1 step/s.
    assert b_jct(True) == pytest.approx((12.0 - 1.0) + (10.0 - 6.0 * pair))
