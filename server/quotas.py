"""A tenant's quotas, checked where studies start or run again: one at a time per tenant.

``max_running_studies`` and ``max_trials_per_study`` (``ft_tenants``, set by the admin) are
checked under a lock on the tenant (:func:`lock_tenant`): its row on PostgreSQL, SQLite's
write lock there, so two concurrent creates cannot both pass a quota with room for one
(``tests/server/test_quota_race.py``). Study creation (the service), resume and more trials
(the loop's lifecycle) and the admin's quota changes (``server/tenants.py``) all take it.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from fusetune.server.db import Study, StudyState, Tenant
from fusetune.server.db.engine import lock_for_write
from fusetune.server.errors import Conflict, Invalid

__all__ = ["check_running_quota", "check_trials_quota", "lock_tenant"]


def check_trials_quota(tenant: Tenant, n_trials: int) -> None:
    """A study of ``tenant`` may have ``n_trials`` trials: Invalid naming ``n_trials`` when that
    is over the tenant's ``max_trials_per_study``."""
    if tenant.max_trials_per_study is not None and n_trials > tenant.max_trials_per_study:
        raise Invalid(
            "n_trials",
            f"n_trials={n_trials} is over tenant {tenant.name!r}'s quota max_trials_per_study="
            f"{tenant.max_trials_per_study}",
        )


def lock_tenant(session: Session, name: str) -> Tenant | None:
    """The tenant ``name`` (None: no such tenant), locked until the transaction ends, so that
    the quota checks and writes of its transactions run one at a time: its row on PostgreSQL
    (``SELECT ... FOR UPDATE``), the database's write lock on SQLite, which has no row locks
    (``db.engine.lock_for_write``)."""
    lock_for_write(session)
    return session.get(Tenant, name, with_for_update=True, populate_existing=True)


def check_running_quota(session: Session, tenant: Tenant) -> None:
    """``tenant`` may run one more study (a new one, or one that runs again): Conflict naming
    ``max_running_studies`` when it runs as many as its quota. Lock the tenant first
    (:func:`lock_tenant`); a caller that read it otherwise is serialised here, on SQLite too."""
    if lock_for_write(session):  # the tenant was read before the lock: its quota may have changed
        session.refresh(tenant)
    if tenant.max_running_studies is not None:
        running = session.scalar(
            select(func.count()).select_from(Study).where(Study.tenant == tenant.name, Study.state == StudyState.RUNNING)
        )
        if (running or 0) >= tenant.max_running_studies:
            raise Conflict(
                "max_running_studies",
                f"tenant {tenant.name!r} runs {running} studies, its quota max_running_studies="
                f"{tenant.max_running_studies}; wait for one to complete",
                where="tenant",
            )
