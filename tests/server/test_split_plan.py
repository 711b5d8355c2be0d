"""When an idle device takes half of a running array's members: split_plan, given measured speeds."""

from __future__ import annotations

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
