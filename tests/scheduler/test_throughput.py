"""Tests for the fused-array throughput model and the array sizing rule."""

from __future__ import annotations

import pytest

from fusetune.scheduler import SpeedupCurve, ThroughputModel, fit_points


def test_curve_matches_hfta_calibration_points() -> None:
    # PointNet on V100: about 5x at B=9 -> c = 0.1; on A100: about 13x at B=25 -> c = 1/26.
    assert SpeedupCurve(1.0, 0.1).rate(9) == pytest.approx(5.0)
    assert SpeedupCurve(1.0, 1 / 26).rate(25) == pytest.approx(13.0, rel=1e-3)
    assert SpeedupCurve(2.0, 1.0).rate(8) == pytest.approx(2.0)  # c = 1: fusing never pays


def test_prior_is_documented_default() -> None:
    model = ThroughputModel(prior_solo={"v100": 3.0})
    assert model.curve("sig", "v100") == SpeedupCurve(3.0, 0.5)
    assert model.curve("sig", "unknown").solo_steps_per_s == 1.0


def test_observe_learns_solo_then_marginal_cost() -> None:
    model = ThroughputModel(smoothing=1.0)
    model.observe("s", "v100", 1, 10.0)
    assert model.curve("s", "v100").solo_steps_per_s == pytest.approx(10.0)
    model.observe("s", "v100", 9, 50.0)  # 5x at B=9 -> c = 0.1
    assert model.curve("s", "v100").marginal_cost == pytest.approx(0.1)
    assert model.rate("s", "v100", 9) == pytest.approx(50.0)


def test_observe_without_learning_c_rescales_the_solo_speed() -> None:
    # The dry runs set c = 0.1 and T1 = 10; an array of 9 then measures 25 models·steps/s:
    # half of what the curve predicts, so the device runs this class at T1 = 5, same c.
    model = ThroughputModel(smoothing=1.0)
    model.set_curve("s", "cpu", SpeedupCurve(10.0, 0.1, base_bytes=7, member_bytes=3))
    sized = model.array_size("s", "cpu", 1_000, 16, 0.3)
    model.observe("s", "cpu", 9, 25.0, learn_marginal_cost=False)
    assert model.curve("s", "cpu") == SpeedupCurve(pytest.approx(5.0), 0.1, 7, 3)
    assert model.array_size("s", "cpu", 1_000, 16, 0.3) == sized == 16  # B is the dry runs' call


def test_observe_smooths_and_rejects_garbage() -> None:
    model = ThroughputModel(smoothing=0.5)
    model.observe("s", "k80", 1, 4.0)
    model.observe("s", "k80", 1, 8.0)
    assert model.curve("s", "k80").solo_steps_per_s == pytest.approx(6.0)
    with pytest.raises(ValueError):
        model.observe("s", "k80", 0, 1.0)
    with pytest.raises(ValueError):
        model.observe("s", "k80", 2, float("nan"))


def test_array_size_rule_memory_and_efficiency() -> None:
    model = ThroughputModel()
    model.set_curve("small", "v100", SpeedupCurve(1.0, 0.1, base_bytes=1_000, member_bytes=1_000))
    model.set_curve("big", "v100", SpeedupCurve(1.0, 1.0))
    # eta(B) = 1/(1 + 0.1 (B-1)) >= 0.5  <=>  B <= 11.
    assert model.array_size("small", "v100", 10**9, 64, 0.5) == 11
    assert model.array_size("small", "v100", 6_000, 64, 0.5) == 5  # memory binds
    assert model.array_size("small", "v100", 500, 64, 0.5) == 0  # not even one fits
    assert model.array_size("big", "v100", 10**9, 64, 0.5) == 1  # fusing does not pay
    assert model.array_size("small", "v100", 10**9, 4, 0.5) == 4  # hard cap


def test_invalid_model_arguments() -> None:
    with pytest.raises(ValueError):
        ThroughputModel(smoothing=0.0)
    with pytest.raises(ValueError):
        ThroughputModel(prior_marginal_cost=1.5)


def test_fit_curve_from_dry_run() -> None:
    from fusetune.scheduler import fit_curve

    truth = SpeedupCurve(10.0, 0.1)
    measured = {b: truth.rate(b) for b in (1, 2, 4, 8)}
    curve = fit_curve(10.0, measured, base_bytes=100, member_bytes=50)
    assert curve.marginal_cost == pytest.approx(0.1)
    assert (curve.base_bytes, curve.member_bytes) == (100, 50)
    assert fit_curve(10.0, {1: 10.0}).marginal_cost == 0.5  # no fused size: the prior
    with pytest.raises(ValueError):
        fit_curve(0.0, {})


def test_fit_points_recovers_the_curve_real_arrays_measured() -> None:
    truth = SpeedupCurve(1322.0, 0.133)  # digits MLP on one CPU thread: B=32 at 8,240 models·steps/s
    fitted = fit_points({b: truth.rate(b) for b in (1, 8, 32)})
    assert fitted.solo_steps_per_s == pytest.approx(1322.0)
    assert fitted.marginal_cost == pytest.approx(0.133)
    # Two sizes without B = 1 still pin both numbers down.
    assert fit_points({16: truth.rate(16), 32: truth.rate(32)}).marginal_cost == pytest.approx(0.133)


def test_fit_points_with_one_size_keeps_the_prior_marginal_cost() -> None:
    fitted = fit_points({16: 4000.0}, prior_marginal_cost=0.1)
    assert fitted.marginal_cost == 0.1
    assert fitted.rate(16) == pytest.approx(4000.0)
    # Noise that would make fusing cost more than a solo model (c > 1) is clamped to c = 1.
    assert fit_points({1: 1000.0, 8: 500.0}).marginal_cost == 1.0


@pytest.mark.parametrize("points", [{}, {0: 10.0}, {4: -1.0}, {4: float("nan")}])
def test_fit_points_rejects_what_no_array_can_measure(points: dict[int, float]) -> None:
    with pytest.raises(ValueError, match="points"):
        fit_points(points)
