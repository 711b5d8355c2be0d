"""Fencing: once another scheduler has taken a newer epoch, the database refuses every commit
of the old one's sessions, on SQLite and on PostgreSQL (server/fencing.py)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from fusetune.server.db import Tenant, get_loop_sessionmaker, upgrade
from fusetune.server.fencing import StaleScheduler, fence, take_epoch


def tenants(url: str) -> set[str]:
    with get_loop_sessionmaker(url)() as session:
        return set(session.scalars(sa.select(Tenant.name)))


def test_a_replaced_scheduler_commits_nothing_and_the_new_one_commits(database_url: str) -> None:
    upgrade(database_url)
    plain = get_loop_sessionmaker(database_url)
    first = take_epoch(plain)
    old = fence(plain, first)
    with old.begin() as session:
        session.add(Tenant(name="before"))
    assert "before" in tenants(database_url)  # the scheduler of record writes

    second = take_epoch(plain)  # another server takes over
    assert second == first + 1
    with old() as session:
        session.add(Tenant(name="stale"))
        session.execute(sa.update(Tenant).where(Tenant.name == "before").values(weight=9.0))
        with pytest.raises(StaleScheduler):
            session.commit()
    with plain() as session:
        assert "stale" not in tenants(database_url)
        assert session.get(Tenant, "before").weight == 1.0  # nothing of the stale transaction landed

    new = fence(plain, second)
    with new.begin() as session:
        session.add(Tenant(name="after"))
    assert {"before", "after"} <= tenants(database_url)


def test_each_scheduler_start_takes_a_newer_epoch(database_url: str) -> None:
    upgrade(database_url)
    plain = get_loop_sessionmaker(database_url)
    epochs = [take_epoch(plain) for _ in range(3)]
    assert epochs == sorted(epochs) and len(set(epochs)) == 3
