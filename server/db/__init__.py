"""fusetune's tables and the means to reach them."""

from .engine import (
    engine_kwargs, get_engine, get_loop_sessionmaker, get_optuna_storage, get_read_engine, get_read_sessionmaker, get_sessionmaker, retry_disconnected, upgrade,
)
from . import bulk, revisions  # noqa: F401  (register their hooks: rows held back to commit, trials' revisions)
from .models import (
    Array,
    ArrayMember,
    ArrayState,
    Base,
    Event,
    Study,
    StudyState,
    Tenant,
    Throughput,
    Token,
    Trial,
    TrialRevision,
    TrialState,
    Worker,
    utcnow,
)

__all__ = [
    "Array",
    "ArrayMember",
    "ArrayState",
    "Base",
    "Event",
    "Study",
    "StudyState",
    "Tenant",
    "Throughput",
    "Token",
    "Trial",
    "TrialRevision",
    "TrialState",
    "Worker",
    "engine_kwargs",
    "get_engine",
    "get_loop_sessionmaker",
    "get_optuna_storage",
    "get_read_engine",
    "get_read_sessionmaker",
    "get_sessionmaker",
    "retry_disconnected",
    "upgrade",
    "utcnow",
]
