"""When an idle device takes half of a running array's members, or all of them to a faster device
type: split_plan, given measured speeds."""

from __future__ import annotations

import pytest

from fusetune.scheduler import SpeedupCurve
from fusetune.server.loop.dispatch import split_plan

# A compute-bound class (a member costs 80% of a solo model) and a small one that fuses well.
CNN = SpeedupCurve(solo_steps_per_s=10.0, marginal_cost=0.8).rate
MLP = SpeedupCurve(solo_steps_per_s=100.0, marginal_cost=0.15).rate


def test_half_the_members_with_the_most_epochs_left_move() -> None:
    # The cnn-32x5 sweep: the other class's device went idle with 16 members at 0.65 s an
    # epoch and two epochs left after this one.
    remaining = {i: 2 for i in range(16)}
    movers, saved = split_plan(remaining, epoch_s=0.65, build_s=0.02, rate=CNN)
    assert movers == list(range(8))
    assert 0.25 * 2 * 0.65 <= saved < 2 * 0.65


def test_those_on_their_last_epochs_stay() -> None:
    remaining = {1: 0, 2: 0, 3: 5, 4: 5}
    movers, _ = split_plan(remaining, epoch_s=0.65, build_s=0.0, rate=CNN)
    assert movers == [3]  # of the two that go on, one moves; the two that end at this boundary stay


def test_an_array_close_to_its_end_stays_whole() -> None:
    # mlp-64x10: 32 members at 80 ms an epoch, two epochs left. Half of them alone would
    # train for 2 x 46 ms after a move that costs their builds and a scheduling round: no gain.
    movers, saved = split_plan({i: 2 for i in range(32)}, epoch_s=0.08, build_s=0.017, rate=MLP)
    assert (movers, saved) == ([], 0.0)


def test_nothing_moves_without_a_measured_epoch_or_a_second_member() -> None:
    assert split_plan({i: 9 for i in range(8)}, epoch_s=0.0, build_s=0.0, rate=CNN) == ([], 0.0)
    assert split_plan({1: 9}, epoch_s=1.0, build_s=0.0, rate=CNN) == ([], 0.0)
    assert split_plan({1: 0, 2: 0}, epoch_s=1.0, build_s=0.0, rate=CNN) == ([], 0.0)


def test_a_costly_move_is_not_made() -> None:
    # Building the movers again takes longer than what their halves would save.
    assert split_plan({i: 3 for i in range(16)}, epoch_s=0.65, build_s=5.0, rate=CNN) == ([], 0.0)


# The live-vs-simulated test's job b: 3.75 steps/s alone on the slow type, 4.5 on the fast one.
B_SLOW = SpeedupCurve(solo_steps_per_s=3.75, marginal_cost=0.5).rate
B_FAST = SpeedupCurve(solo_steps_per_s=4.5, marginal_cost=0.5).rate
# Its job a: three times faster on the fast type.
A_SLOW = SpeedupCurve(solo_steps_per_s=3.0, marginal_cost=0.3).rate
A_FAST = SpeedupCurve(solo_steps_per_s=9.0, marginal_cost=0.3).rate


def test_a_lone_member_moves_to_an_idle_device_three_times_faster() -> None:
    # One member of a on the slow type, 1.33 s an epoch, three epochs after this one: on the
    # fast type they take a third of that.
    movers, saved = split_plan({7: 3}, epoch_s=4 / 3.0, build_s=0.01, rate=A_SLOW, target_rate=A_FAST)
    assert movers == [7]
    assert saved == pytest.approx(3 * 4 / 3.0 - (0.03 + 0.05 + 3 * 4 / 9.0))


def test_to_a_faster_type_the_better_of_half_and_all_moves() -> None:
    # Three members of a on the slow type (2.13 s an epoch), two epochs after this one. Half
    # (one) on the fast type ends in 2 x 0.44 s, but the two that stay take 2 x 1.73 s; all
    # three there take 2 x 0.71 s: all move.
    epoch_s = 4 * 3 / A_SLOW(3)
    movers, saved = split_plan({1: 2, 2: 2, 3: 2}, epoch_s=epoch_s, build_s=0.0, rate=A_SLOW, target_rate=A_FAST)
    assert movers == [1, 2, 3]
    assert saved == pytest.approx(2 * epoch_s - (0.05 + 2 * 4 * 3 / A_FAST(3)))
    # Two members of b (1.2x faster there, 1.6 s an epoch), three epochs after this one: both
    # on the fast type would take 3 x 1.33 s, one there 3 x 0.89 s while the other stays
    # alone (3 x 1.07 s): half moves.
    movers, saved = split_plan({1: 3, 2: 3}, epoch_s=4 * 2 / B_SLOW(2), build_s=0.0, rate=B_SLOW, target_rate=B_FAST)
    assert movers == [1]
    assert saved == pytest.approx(3 * 1.6 - 3 * 4 / 3.75)


def test_nothing_moves_to_a_type_barely_faster_or_slower() -> None:
    # b alone: 4.5 against 3.75 steps/s saves a sixth of the time left, under the 25 % asked.
    assert split_plan({1: 3}, epoch_s=4 / 3.75, build_s=0.0, rate=B_SLOW, target_rate=B_FAST) == ([], 0.0)
    assert split_plan({1: 3}, epoch_s=4 / 9.0, build_s=0.0, rate=A_FAST, target_rate=A_SLOW) == ([], 0.0)
    # The idle type's speed for the class is not known (a curve of rate 0): nothing moves there.
    assert split_plan({1: 3}, epoch_s=1.0, build_s=0.0, rate=A_SLOW, target_rate=lambda b: 0.0) == ([], 0.0)


def test_an_array_never_moves_whole_to_a_device_of_its_own_type() -> None:
    movers, _ = split_plan({i: 4 for i in range(4)}, epoch_s=1.0, build_s=0.0, rate=CNN)
    assert movers == [0, 1]
