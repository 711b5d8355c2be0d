"""FusionSampler: any Optuna sampler, made to suggest trials that fuse into one array.

fusetune trains the trials whose models have one shape signature as one fused array. A
sampler that draws the hidden width, the batch size or the layer count afresh for every
trial spreads a batch of trials over many signatures, and the batch trains as many small
arrays. FusionSampler keeps those *non-fusible* parameters equal within a *group* of up to
``group_size`` trials asked while earlier members of the group still run, and lets the
wrapped sampler draw every other (*fusible*) parameter per trial.

Group membership lives in each trial's system attrs (:data:`ATTR`), never in this object
(it only memoizes what finished trials say, which never changes, so that asking stays cheap
as a study grows), so the groups are the same whichever thread, process or pickled copy of
the sampler asks:
``study.optimize(n_jobs=...)``, ask-and-tell and several processes on one storage all see
them. A lock per storage makes each decision atomic between the threads (and the samplers)
of one process; between processes every write is followed by a read that undoes a clash
(see :meth:`_settle`), so a race at worst splits a group in two and never mixes values or
overfills one. An in-memory storage has no other process: there the read is skipped.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, BruteForceSampler, GridSampler
from optuna.storages import InMemoryStorage
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

if TYPE_CHECKING:
    from fusetune.workers.workloads import Workload

__all__ = ["ATTR", "FusionSampler", "fusion_group"]

#: The trial system attr that records a trial's group: ``{"number": the trial's own number,
#: "group": group id, "values": {non-fusible param: value}, "refounds": int}``. The number
#: tells a trial's own record from one copied onto another trial (RetryFailedTrialCallback
#: copies every system attr of the failed trial to its retry).
ATTR = "fusion_sampler"

#: Samplers that enumerate their space: each point once, so FusionSampler leaves their choices be.
_ENUMERATING = (GridSampler, BruteForceSampler)

#: Trials that are still running for the purpose of keeping their group open.
_LIVE = (TrialState.RUNNING, TrialState.WAITING)

# One lock per storage, shared by every FusionSampler of the process (and by pickled copies):
# two samplers on one storage place their trials one at a time, as two threads of one do.
_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()
_UNREFERENCEABLE = threading.RLock()  # for a storage that cannot be weakly referenced


def _lock_of(storage: Any) -> threading.RLock:
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.get(storage)
            if lock is None:
                lock = _LOCKS[storage] = threading.RLock()
        except TypeError:
            return _UNREFERENCEABLE
    return lock


def fusion_group(trial: FrozenTrial) -> str | None:
    """The id of the group a trial belongs to, or None if no FusionSampler placed it.

    Trials with one id share every non-fusible parameter value they have.
    """
    record = trial.system_attrs.get(ATTR)
    if not isinstance(record, dict) or record.get("number") != trial.number:
        return None
    group = record.get("group")
    return group if isinstance(group, str) else None


def _contains(distribution: BaseDistribution, value: Any) -> bool:
    """Whether ``value`` is one of ``distribution``'s values (a dynamic space may have lost it)."""
    try:
        internal = distribution.to_internal_repr(value)
    except (ValueError, TypeError):
        return False
    return bool(distribution._contains(internal))


def _plain(distribution: BaseDistribution, value: Any) -> Any:
    """``value`` as the distribution's own Python value (a numpy scalar or 64.0 for an int is
    not JSON the way a system attr must be)."""
    return distribution.to_external_repr(distribution.to_internal_repr(value))


def _same(a: Any, b: Any) -> bool:
    """Equal parameter values; True and 1 are different categorical choices."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)


@dataclass
class _Member:
    """One trial as its group sees it."""

    trial_id: int
    number: int
    live: bool
    group: str
    refounds: int
    values: dict[str, Any] = field(default_factory=dict)  # non-fusible name -> value


def _member_of(trial: FrozenTrial, non_fusible: frozenset[str]) -> _Member | None:
    """The trial's own record of its group, or None (no FusionSampler placed it)."""
    group = fusion_group(trial)
    if group is None:
        return None
    record = trial.system_attrs[ATTR]
    return _Member(
        trial_id=trial._trial_id,
        number=trial.number,
        live=trial.state in _LIVE,
        group=group,
        refounds=int(record.get("refounds", 0)),
        values=_intended(trial, non_fusible, record),
    )


@dataclass
class _Finished:
    """The groups of a study's finished trials, read once: a finished trial never changes.

    ``upto`` trials, numbered 0 to ``upto - 1``, are all finished and read into ``groups``,
    so a view reads only the trials from the oldest unfinished one on. It is a memo of what
    the storage holds, not a second record: dropping it (a pickled copy has none) costs one
    full read.
    """

    first_trial_id: int
    upto: int = 0
    groups: dict[str, list[_Member]] = field(default_factory=dict)
    # The members read from unfinished trials, each with the FrozenTrial it was read from: valid
    # while the storage returns that very object (an in-memory storage replaces a trial's
    # object on every change; a database storage returns new ones on every read, which never
    # match). A batch of asks then reads each trial once, not once per ask.
    unfinished: dict[int, tuple[FrozenTrial, _Member | None]] = field(default_factory=dict)

    def member(self, trial: FrozenTrial, non_fusible: frozenset[str]) -> _Member | None:
        """:func:`_member_of` ``trial``, from the memo while the trial is unchanged (views only
        read it; :meth:`FusionSampler._member` hands out a copy to change)."""
        memo = self.unfinished.get(trial._trial_id)
        if memo is None or memo[0] is not trial:
            memo = self.unfinished[trial._trial_id] = (trial, _member_of(trial, non_fusible))
        return memo[1]


class _View:
    """The groups of a study that may still take or decide anything, as the storage holds them.

    A group none of whose members runs is closed; only groups with a member among ``recent``
    (the trials from the oldest unfinished one on) are kept, with their finished members
    from ``finished``.
    """

    def __init__(self, recent: Sequence[FrozenTrial], finished: _Finished, non_fusible: frozenset[str]) -> None:
        self.members: dict[int, _Member] = {}  # trial id -> member
        self.groups: dict[str, list[_Member]] = {}  # group id -> members, by trial number
        for trial in recent:
            member = finished.member(trial, non_fusible)
            if member is not None:
                self.members[member.trial_id] = member
                self.groups.setdefault(member.group, []).append(member)
        for group, members in self.groups.items():
            members.extend(finished.groups.get(group, ()))
            members.sort(key=lambda m: m.number)

    def values_of(self, group: str, besides: int) -> dict[str, Any]:
        """The group's non-fusible values, from its members other than trial ``besides``.

        Members agree (a clash makes one of them leave, see ``FusionSampler._settle``); if a
        clash is in flight, the earliest member's value is the group's.
        """
        out: dict[str, Any] = {}
        for member in self.groups.get(group, []):
            if member.trial_id != besides:
                for name, value in member.values.items():
                    out.setdefault(name, value)
        return out

    def clashes(self, member: _Member, names: Iterable[str]) -> bool:
        """Whether another member of ``member``'s group has a different value for one of ``names``."""
        for other in self.groups.get(member.group, []):
            if other.trial_id == member.trial_id:
                continue
            for name in names:
                if name in other.values and name in member.values and not _same(other.values[name], member.values[name]):
                    return True
        return False


def _intended(trial: FrozenTrial, non_fusible: frozenset[str], record: Mapping[str, Any] | None) -> dict[str, Any]:
    """A trial's non-fusible values: those it recorded, its enqueued ones, and its params.

    Params win (they are what the trial uses), then enqueued values (Optuna uses them
    before asking a sampler), then what the sampler recorded while deciding.
    """
    values: dict[str, Any] = {}
    if record is not None:
        values.update({k: v for k, v in dict(record.get("values") or {}).items() if k in non_fusible})
    fixed = trial.system_attrs.get("fixed_params") or {}
    values.update({k: v for k, v in fixed.items() if k in non_fusible})
    values.update({k: v for k, v in trial.params.items() if k in non_fusible})
    return values


class FusionSampler(BaseSampler):
    """Wraps ``base_sampler`` so that the trials it suggests fuse into few arrays.

    Parameters named in ``non_fusible`` (those that change a trial's shape signature: widths,
    layer counts, batch size, optimizer) are sampled by ``base_sampler`` once per group and
    shared by the group's members; every other parameter is fusible and sampled by
    ``base_sampler`` for each trial. A trial joins the oldest group that has fewer than
    ``group_size`` members, one of them still running (or waiting), and no value that clashes
    with the trial's enqueued params; otherwise it opens a new group. A non-fusible value the
    group has already chosen wins over what the base sampler suggests; one first sampled by a
    later member (a conditional parameter) becomes the group's. If the group's value is not
    in the parameter's distribution in this trial (a dynamic space), the trial leaves for a
    new group and the base sampler chooses.

    A sampler that enumerates its space (``GridSampler``, ``BruteForceSampler``) is left to
    choose every value itself: putting a group's values over the point it picked would try
    that point's neighbour twice and never try the point, so the grid would not be covered.
    Its trials that share a shape still train as one array (the service fuses by signature).

    Args:
        base_sampler: the sampler that chooses every value (TPE, GP, CMA-ES, NSGA-II, ...).
        non_fusible: names of the parameters that must be equal for trials to share an
            array. :meth:`for_workload` derives them from a fusetune workload.
        group_size: most trials per group; fusetune uses the study's largest array size.

    Raises:
        TypeError: ``base_sampler`` is not an Optuna sampler, or ``non_fusible`` is a single
            string or holds a non-string.
        ValueError: ``group_size`` is below 1.
    """

    def __init__(self, base_sampler: BaseSampler, *, non_fusible: Iterable[str], group_size: int = 8) -> None:
        if not isinstance(base_sampler, BaseSampler):
            raise TypeError(f"base_sampler must be an optuna.samplers.BaseSampler, got {type(base_sampler).__name__}")
        if isinstance(non_fusible, (str, bytes)):
            raise TypeError(f"non_fusible must be a collection of parameter names, not the single string {non_fusible!r}")
        names = frozenset(non_fusible)
        bad = sorted(repr(n) for n in names if not isinstance(n, str))
        if bad:
            raise TypeError(f"non_fusible must hold parameter names (str), got {', '.join(bad)}")
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self._base = base_sampler
        self._enumerates = isinstance(base_sampler, _ENUMERATING)
        self._non_fusible = names
        self._group_size = group_size
        # What finished trials say, per storage and study (see _Finished); never pickled.
        self._finished: weakref.WeakKeyDictionary[Any, dict[int, _Finished]] = weakref.WeakKeyDictionary()

    @classmethod
    def for_workload(
        cls,
        base_sampler: BaseSampler,
        workload: str | Workload,
        *,
        group_size: int = 8,
        distributions: Mapping[str, BaseDistribution] | None = None,
        signature: Callable[[Mapping[str, Any]], str] | None = None,
    ) -> FusionSampler:
        """A FusionSampler whose non-fusible parameters are derived from a fusetune workload.

        They are the parameters that change the trial's shape signature as the service
        computes it (see :func:`fusetune.workers.samplers.non_fusible_params`, which imports
        torch and fusetune's server code; the sampler itself needs only Optuna).
        """
        from fusetune.workers.samplers._workload import non_fusible_params

        names = non_fusible_params(workload, distributions=distributions, signature=signature)
        return cls(base_sampler, non_fusible=names, group_size=group_size)

    # -- what it was built with ------------------------------------------------------------
    @property
    def base_sampler(self) -> BaseSampler:
        """The wrapped sampler."""
        return self._base

    @property
    def non_fusible(self) -> frozenset[str]:
        """Names of the parameters shared by a group."""
        return self._non_fusible

    @property
    def group_size(self) -> int:
        """Most trials per group."""
        return self._group_size

    def __repr__(self) -> str:
        return (
            f"FusionSampler({type(self._base).__name__}, non_fusible={sorted(self._non_fusible)}, "
            f"group_size={self._group_size})"
        )

    # -- pickling: the memo stays behind, each copy makes its own -------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_finished"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._finished = weakref.WeakKeyDictionary()

    # -- BaseSampler --------------------------------------------------------------------------
    def reseed_rng(self) -> None:
        self._base.reseed_rng()

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        """The base sampler's ``before_trial``, then the trial joins a group or opens one."""
        self._base.before_trial(study, trial)
        if self._enumerates:
            return
        with _lock_of(study._storage):
            self._place(study, trial._trial_id)

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        # The base sampler keeps its whole space, non-fusible parameters included (CMA-ES and
        # friends restart on a space that changes between trials); sample_relative puts the
        # group's values over what it suggests for them.
        return self._base.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        with _lock_of(study._storage):
            proposed = self._base.sample_relative(study, trial, search_space)
            names = [n for n in proposed if n in self._non_fusible and n in search_space]
            if not names or self._enumerates:
                return proposed
            out = dict(proposed)
            member, view = self._member(study, trial._trial_id)
            group = view.values_of(member.group, besides=member.trial_id)
            # The trial's own values (enqueued ones) come first, then the group's; one that
            # this trial's distribution lacks sends the trial to a new group of its own.
            chosen = {}
            for name in names:
                if name in member.values:
                    chosen[name] = member.values[name]
                elif name in group:
                    chosen[name] = group[name]
            if any(not _contains(search_space[n], v) for n, v in chosen.items()):
                self._refound(study, member)
                chosen = {n: v for n, v in chosen.items() if n in member.values and _contains(search_space[n], v)}
            for name in names:
                out[name] = _plain(search_space[name], chosen.get(name, proposed[name]))
                member.values[name] = out[name]
            self._write(study, member)
            self._settle(study, member, names)
            return out

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        if param_name not in self._non_fusible or self._enumerates:
            return self._base.sample_independent(study, trial, param_name, param_distribution)
        with _lock_of(study._storage):
            member, view = self._member(study, trial._trial_id)
            if param_name in member.values:  # enqueued, or recorded by sample_relative
                known, value = True, member.values[param_name]
            else:
                group = view.values_of(member.group, besides=member.trial_id)
                known, value = param_name in group, group.get(param_name)
            if known and not _contains(param_distribution, value):
                # A dynamic space: the group's value is not on offer here. Leave rather than raise.
                self._refound(study, member)
                known = False
            if not known:
                # Only the group's first trial with this parameter asks the base sampler.
                value = self._base.sample_independent(study, trial, param_name, param_distribution)
            member.values[param_name] = _plain(param_distribution, value)
            self._write(study, member)
            self._settle(study, member, [param_name])
            return member.values[param_name]

    def after_trial(
        self, study: Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self._base.after_trial(study, trial, state, values)

    # -- groups ---------------------------------------------------------------------------------
    def _view(self, study: Study) -> _View:
        # The storage, not ``study.get_trials``: a pruner's filtered study (Hyperband's
        # brackets) would hide members of the trial's group.
        storage = study._storage
        trials = storage.get_all_trials(study._study_id, deepcopy=False)  # by number, from 0
        if not trials:
            return _View((), _Finished(-1), self._non_fusible)
        try:
            studies = self._finished.setdefault(storage, {})
        except TypeError:  # a storage that cannot be weakly referenced: read everything each time
            studies = {}
        finished = studies.get(study._study_id)
        if (
            finished is None
            or finished.first_trial_id != trials[0]._trial_id  # another study under a reused id
            or finished.upto > len(trials)
            or (finished.upto > 0 and trials[finished.upto - 1].number != finished.upto - 1)
        ):
            finished = studies[study._study_id] = _Finished(trials[0]._trial_id)
        i = finished.upto
        while i < len(trials) and trials[i].state.is_finished() and trials[i].number == i:
            member = _member_of(trials[i], self._non_fusible)
            if member is not None:
                finished.groups.setdefault(member.group, []).append(member)
            finished.unfinished.pop(trials[i]._trial_id, None)
            i += 1
        finished.upto = i
        return _View(trials[i:], finished, self._non_fusible)

    def _member(self, study: Study, trial_id: int) -> tuple[_Member, _View]:
        """The trial's record and the view it was read in; a trial no FusionSampler placed
        yet (asked through another sampler before this one) is placed now."""
        view = self._view(study)
        if trial_id not in view.members:
            self._place(study, trial_id)
            view = self._view(study)
        member = view.members[trial_id]  # the view's is the memo's (_Finished.member): change a copy
        return dataclasses.replace(member, values=dict(member.values)), view

    def _place(self, study: Study, trial_id: int) -> None:
        """Join the oldest open group the trial's enqueued values agree with, or open one."""
        trial = study._storage.get_trial(trial_id)
        view = self._view(study)
        own = _intended(trial, self._non_fusible, None)
        candidates = []
        for group, members in view.groups.items():
            members = [m for m in members if m.trial_id != trial_id]
            if not members or len(members) >= self._group_size or not any(m.live for m in members):
                continue
            values = view.values_of(group, besides=trial_id)
            if all(_same(values[n], v) for n, v in own.items() if n in values):
                candidates.append((members[0].number, group))
        member = _Member(trial_id, trial.number, True, str(trial.number), 0, own)
        if candidates:
            member.group = min(candidates)[1]
            self._write(study, member)
            self._settle(study, member, own, joined=True)
        else:
            self._write(study, member)

    def _write(self, study: Study, member: _Member) -> None:
        # The values are the trial's params: JSON, as Optuna's storages hold them.
        record: dict[str, Any] = {"number": member.number, "group": member.group, "values": member.values, "refounds": member.refounds}
        study._storage.set_trial_system_attr(member.trial_id, ATTR, record)

    def _refound(self, study: Study, member: _Member) -> None:
        """The trial leaves its group for a new one of its own, keeping its values."""
        member.refounds += 1
        member.group = f"{member.number}.{member.refounds}"
        self._write(study, member)

    def _settle(self, study: Study, member: _Member, names: Iterable[str], joined: bool = False) -> None:
        """Read back after a write: leave the group if another process's write clashes with it.

        Every trial writes its values (or its joining) before it reads, so of two clashing
        writes the later one's read sees the earlier one: that trial leaves. Threads of one
        process never clash (the storage's lock orders them); several processes on one
        storage may, and then a group splits in two instead of mixing values or growing past
        its size. Only this process writes Optuna's in-memory storage: nothing to read back
        (two of the four group reads of an ask, the control plane's included). A subclass
        may stand for a storage others share, and reads back as any other.
        """
        if type(study._storage) is InMemoryStorage:
            return
        view = self._view(study)
        current = view.members.get(member.trial_id)
        if current is None or current.group != member.group:
            return
        overfull = joined and len(view.groups[member.group]) > self._group_size
        if overfull or view.clashes(current, list(names)):
            self._refound(study, member)
