"""Where a running array takes waiting trials of its class: now, or in the place of a member on its last epoch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fusetune.server.loop.dispatch import offer_plan


def test_the_places_ended_members_freed_are_taken_at_the_next_boundary() -> None:
    # Two of four pruned, none near its end: two newcomers join now, none later.
    assert offer_plan(size=4, present=2, ends=[]) == (2, [])


def test_a_member_on_its_last_epoch_gets_a_successor_where_it_leaves() -> None:
    assert offer_plan(size=4, present=4, ends=[6, 6, 7, 7]) == (0, [6, 6, 7, 7])
    # An array of one goes on as a chain of trials.
    assert offer_plan(size=1, present=1, ends=[4], chain=True) == (0, [4])


def test_a_chain_offers_only_the_places_of_members_that_leave() -> None:
    """The mlp-256x10 sweep on PostgreSQL: 31 of an array's 64 members had ended, the other
    33 were on their last epoch. The chain offered 64 successors for 33 places, and every
    scheduling round failed (zip() argument 2 is shorter than argument 1) until they left."""
    now, places = offer_plan(size=64, present=33, ends=[10] * 33, chain=True)
    assert (now, places) == (0, [10] * 33)


def test_newcomers_take_the_latest_places_when_the_array_is_smaller_now() -> None:
    # The scheduler sized the class's arrays at 3: of the five members leaving at 8 and 9,
    # the three that leave last make room, so the array is at most 3 after them.
    assert offer_plan(size=3, present=5, ends=[8, 8, 9, 9, 9]) == (0, [9, 9, 9])


@given(
    size=st.integers(1, 64),
    stayers=st.integers(0, 64),
    ends=st.lists(st.integers(1, 30), max_size=64).map(sorted),
    chain=st.booleans(),
)
def test_an_array_never_holds_more_than_its_size_because_of_an_offer(size: int, stayers: int, ends: list[int], chain: bool) -> None:
    present = stayers + len(ends)
    now, places = offer_plan(size, present, ends, chain)
    assert len(places) <= len(ends)  # a newcomer per member that leaves, at most
    assert all(a == b for a, b in zip(places, ends[len(ends) - len(places):], strict=True))  # the latest places
    for boundary in sorted({0, *ends}):
        holds = stayers + now + sum(e > boundary for e in ends) + sum(p <= boundary for p in places)
        assert holds <= max(size, present)
