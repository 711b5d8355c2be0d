"""Tests for balanced, deterministic packing of equal-signature trials."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusetune.scheduler import ArrayPlan, PendingTrial, pack


def _trials(sigs: list[str], priorities: list[float] | None = None) -> list[PendingTrial]:
    prios = priorities or [0.0] * len(sigs)
    return [PendingTrial(trial_id=i, signature=s, priority=p) for i, (s, p) in enumerate(zip(sigs, prios))]


def test_eleven_with_max_eight_is_six_plus_five() -> None:
    plans = pack(_trials(["a"] * 11), max_members=8)
    assert [len(p.trial_ids) for p in plans] == [6, 5]
    assert plans[0] == ArrayPlan("a", (0, 1, 2, 3, 4, 5))
    assert plans[1] == ArrayPlan("a", (6, 7, 8, 9, 10))


def test_only_equal_signatures_share() -> None:
    plans = pack(_trials(["a", "b", "a", "c", "b"]), max_members=4)
    assert plans == [ArrayPlan("a", (0, 2)), ArrayPlan("b", (1, 4)), ArrayPlan("c", (3,))]


def test_priority_desc_then_input_order() -> None:
    plans = pack(_trials(["a"] * 5, [0.0, 2.0, 1.0, 2.0, 0.0]), max_members=2)
    assert [p.trial_ids for p in plans] == [(1, 3), (2, 0), (4,)]


def test_max_one_is_one_trial_per_array() -> None:
    assert [p.trial_ids for p in pack(_trials(["a", "a"]), 1)] == [(0,), (1,)]


def test_empty_input() -> None:
    assert pack([], 8) == []


@pytest.mark.parametrize("bad", [0, -3])
def test_max_members_below_one_raises(bad: int) -> None:
    with pytest.raises(ValueError, match="max_members"):
        pack(_trials(["a"]), bad)


def test_duplicate_trial_ids_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        pack([PendingTrial(1, "a"), PendingTrial(1, "a")], 4)


@settings(max_examples=150, deadline=None)
@given(
    sigs=st.lists(st.sampled_from("abcd"), max_size=60),
    prios=st.lists(st.sampled_from([0.0, 1.0, 2.5]), min_size=60, max_size=60),
    max_members=st.integers(1, 12),
)
def test_pack_properties(sigs: list[str], prios: list[float], max_members: int) -> None:
    trials = _trials(sigs, prios[: len(sigs)])
    plans = pack(trials, max_members)
    by_id = {t.trial_id: t for t in trials}
    placed = [i for p in plans for i in p.trial_ids]
    assert sorted(placed) == sorted(by_id)  # every trial exactly once
    for sig in set(sigs):
        group = [p for p in plans if p.signature == sig]
        n = sigs.count(sig)
        assert len(group) == -(-n // max_members)
        sizes = [len(p.trial_ids) for p in group]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= max_members
        ids = [i for p in group for i in p.trial_ids]
        assert ids == sorted(ids, key=lambda i: (-by_id[i].priority, i))
    for p in plans:
        assert {by_id[i].signature for i in p.trial_ids} == {p.signature}
    assert pack(trials, max_members) == plans  # deterministic
