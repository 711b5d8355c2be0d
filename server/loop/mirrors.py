"""The running studies' mirrors (``server/mirror.py``), as the scheduling loop holds them.

One mirror per study and process, with its sampler and pruner built once (a seeded sampler
rebuilt for every ask would repeat its first suggestion). A mirror is built from the rows a
study's creation handed over (:meth:`Mirrors.adopt`: a new sweep's first ask reads
nothing), else read from the database. When a transaction that changed some of a mirror's
trials rolls back, only those trials are read again before the mirror's next use
(:meth:`Mirrors.mark_stale`), never the whole study.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import optuna
from sqlalchemy.orm import Session

from fusetune.server import reads
from fusetune.server.db import Study
from fusetune.server.mirror import CreatedStudy, StudyMirror
from fusetune.server.optuna_specs import SpecError, SpecLimits, check_stored, make_pruner, make_sampler, service_sampler_kwargs
from fusetune.server.schemas import parse_search_space
from fusetune.server.settings import Settings

if TYPE_CHECKING:
    from fusetune.server.loop.packages import PackageRuntime
from fusetune.workers.samplers import FusionSampler, non_fusible_params
from fusetune.workers.signature import trial_signature
from fusetune.workers.workloads import get_workload

__all__ = ["Mirrors", "group_size", "study_sampler", "training_seed"]

log = logging.getLogger(__name__)

#: How long the rows of a study this process created are kept for its first mirror (adopt).
_CREATED_TTL_S = 60.0
#: (workload, search space) -> its non-fusible params: probed once per process, the
#: _MAX_NON_FUSIBLE most recently used kept (tenants can make new spaces without end). Only
#: the loop's thread reads and writes it.
_NON_FUSIBLE: OrderedDict[tuple[str, str], frozenset[str]] = OrderedDict()
_MAX_NON_FUSIBLE = 1024


def group_size(study: Study, settings: Settings, devices: int) -> int:
    """How many trials FusionSampler gives one set of shape-changing values: one device's array.

    A batch of asks fills every device (``devices`` × the array size, at most ``n_trials`` and
    the study's ``max_concurrent_trials``); each group fills one device, so a sweep that fits
    on the devices at once still explores as many shapes as there are devices, instead of one
    shape in one group of the array size.
    """
    cap = study.max_array_size or settings.max_array_size
    batch = min(study.n_trials, settings.ask_batch or devices * cap, study.max_concurrent_trials or study.n_trials)
    return max(1, min(cap, math.ceil(batch / max(1, devices))))


def study_sampler(
    study: Study, settings: Settings, devices: int = 1, packages: PackageRuntime | None = None
) -> optuna.samplers.BaseSampler:
    """The sampler the service asks a study's trials from, built from the study's spec.

    Unless the study opted out (``fusion_sampler``), it is a :class:`FusionSampler` around
    the named sampler: the parameters that change ``trial_signature`` (derived from the
    workload's space by that function) are sampled once per group of up to an array's size.
    """
    config = study.config
    # Built once, with only the kwargs that are not Optuna's defaults (TPE's constant liar,
    # which batches of asks need, where Optuna does not default to it).
    name = config.sampler["name"]
    sampler = make_sampler(name, service_sampler_kwargs(name, config.sampler.get("kwargs") or {}), SpecLimits.of(settings))
    if not config.fusion_sampler or study.driver == "client":
        return sampler  # a client-driven study's trials are asked by its client, with its own FusionSampler
    # Deriving them probes ~150 signatures (0.5 s on the 2-core machine): once per workload
    # and space in a process, not once per study, or every study's first array waits for it.
    # A study's epochs are the same for all its trials, so they never change the answer.
    # A package's code is found by its digest (two tenants' workloads may share a name), and
    # runs in its describer, never here.
    key = (study.package or study.workload, json.dumps(study.search_space, sort_keys=True))
    distributions = parse_search_space(study.search_space) if study.search_space else None
    try:
        if key not in _NON_FUSIBLE:
            if study.package is not None:
                if packages is None or distributions is None:
                    raise ValueError("a package study needs its package's runtime and its search space")
                _NON_FUSIBLE[key] = packages.non_fusible(study, distributions)
            else:
                workload = get_workload(study.workload)
                _NON_FUSIBLE[key] = non_fusible_params(
                    workload, distributions=distributions, signature=lambda params: trial_signature(workload, params),
                )
            if len(_NON_FUSIBLE) > _MAX_NON_FUSIBLE:
                _NON_FUSIBLE.popitem(last=False)  # the least recently used
        else:
            _NON_FUSIBLE.move_to_end(key)
        return FusionSampler(sampler, non_fusible=_NON_FUSIBLE[key], group_size=group_size(study, settings, devices))
    except ValueError as exc:
        # No probe of the space built a model: its trials will fail one by one with their
        # own errors, as they do without FusionSampler; the study must not stop asking.
        log.warning("study %s samples without FusionSampler: %s", study.name, exc)
        return sampler


def training_seed(study: Study) -> int:
    """The seed of a study's inits and data orders: its sampler's seed when it names one, so
    that the same study run twice, on SQLite or on PostgreSQL, trains the same models from
    the same asks; otherwise its id."""
    seed = (study.sampler.get("kwargs") or {}).get("seed")
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else study.id


class Mirrors:
    """Each running study's mirror in this process (see the module docstring).

    Args:
        storage: Optuna's RDB storage on the service's database (a mirror reads it once).
        settings: the caps a stored sampler or pruner is checked against.
        devices: how many devices there are now (FusionSampler's group size).
    """

    def __init__(
        self, storage: optuna.storages.RDBStorage, settings: Settings, devices: Any, packages: PackageRuntime | None = None
    ) -> None:
        self.packages = packages
        self.storage = storage
        self.settings = settings
        self._devices = devices
        self._mirrors: dict[int, StudyMirror] = {}  # fusetune study id -> its Optuna study, in memory
        # Study id -> Optuna trial ids whose mirrored state ran ahead of a transaction that
        # rolled back: read again before the mirror is next used (StudyMirror.reload_trials).
        self._stale: dict[int, set[int]] = {}
        # Studies created in this process, not mirrored yet: their Optuna rows, and when (adopt).
        self._created: dict[int, tuple[CreatedStudy, float]] = {}
        self._created_lock = threading.Lock()
        self._usable: set[int] = set()  # studies whose stored sampler and pruner passed the caps

    def adopt(self, study_id: int, created: CreatedStudy) -> None:
        """A study this process has just created (``created``: its Optuna rows): its mirror is
        built from them, reading nothing back. Any thread."""
        with self._created_lock:
            now = time.monotonic()
            # Kept for the loop's next steps only: a study no step mirrors soon (a client-driven
            # one whose client has not enqueued yet) is read from the database as ever. Only
            # this leader's loop writes the study's trials, so until it mirrors the study the
            # rows are all there is.
            for stale in [i for i, (_, at) in self._created.items() if now - at > _CREATED_TTL_S]:
                del self._created[stale]
            self._created[study_id] = (created, now)

    def of(self, study: Study) -> StudyMirror:
        """The study's Optuna study in memory, loaded from the database once per process."""
        if study.id not in self._mirrors:
            config = study.config
            sampler = study_sampler(study, self.settings, self._devices(), self.packages)
            pruner = (
                make_pruner(config.pruner["name"], config.pruner.get("kwargs"), SpecLimits.of(self.settings))
                if config.pruner else optuna.pruners.NopPruner()
            )
            with self._created_lock:
                created, _ = self._created.pop(study.id, (None, 0.0))
            self._mirrors[study.id] = StudyMirror(self.storage, study.optuna_study_id, sampler, pruner, created=created)
            self._stale.pop(study.id, None)  # loaded whole: nothing of it is stale
        return self.fresh(study.id)

    def of_id(self, session: Session, study_id: int) -> StudyMirror:
        """:meth:`of` by id: the study is read only when its mirror is not loaded yet."""
        if study_id in self._mirrors:
            return self.fresh(study_id)
        study = session.get(Study, study_id)
        assert study is not None, study_id
        return self.of(study)

    def loaded(self, study_id: int) -> StudyMirror | None:
        """The study's mirror if this process has loaded it, as it is (no read)."""
        return self._mirrors.get(study_id)

    def fresh(self, study_id: int) -> StudyMirror:
        """The study's mirror, its stale trials read again first."""
        mirror = self._mirrors[study_id]
        stale = self._stale.get(study_id)
        if stale:
            mirror.reload_trials(self.storage, stale)  # a database error leaves them stale, to retry
            del self._stale[study_id]
        return mirror

    def stopping(self, study: Study) -> StudyMirror:
        """The mirror of a study that asks nothing more (stopping), to end its trials with:
        when none is loaded, its sampler is not built (it may not build: a workload that
        cannot be loaded); any sampler ends trials the same."""
        if study.id not in self._mirrors:
            self._mirrors[study.id] = StudyMirror(
                self.storage, study.optuna_study_id, optuna.samplers.RandomSampler(), optuna.pruners.NopPruner()
            )
        return self.fresh(study.id)

    def mark_stale(self, study_id: int, optuna_trial_ids: Iterable[int]) -> None:
        """A transaction that changed these trials in the study's mirror rolled back: they are
        read again before the mirror is next used; the rest of the mirror stays."""
        if study_id in self._mirrors:
            self._stale.setdefault(study_id, set()).update(optuna_trial_ids)

    def drop(self, study_id: int) -> None:
        """Forget the study's mirror: it ended, or what it asked was never written (its next
        use reads the study again)."""
        self._mirrors.pop(study_id, None)
        self._stale.pop(study_id, None)

    def forget(self, study_id: int) -> None:
        """Drop everything held of a study that no longer runs (SQLite may reuse its id)."""
        self.drop(study_id)
        self._usable.discard(study_id)

    def usable(self, session: Session, study: Study) -> str | None:
        """None when the study's stored sampler and pruner pass this process's allow-list and
        caps (checked once per study, before anything is built from them); else why not. One
        stored before the caps or under larger ones, rebuilt, would fail or stall every round,
        everyone's (``server/optuna_specs.check_stored``)."""
        if study.id in self._usable:
            return None
        config = study.config
        try:
            check_stored(
                config.sampler, config.pruner, limits=SpecLimits.of(self.settings),
                objectives=lambda: reads.objectives(session, study.optuna_study_id),
                search_space=(lambda: parse_search_space(study.search_space or {})) if study.search_space else None,
            )
        except (SpecError, ValueError, KeyError, TypeError) as exc:  # a spec this version refuses, however stored
            return f"its stored sampler or pruner is refused: {exc}"
        self._usable.add(study.id)
        return None
