"""Describing: what the loop learns of each asked trial's model before the trial may train.

Every asked trial gets its fusion key (``workers/signature.py``), the least memory one member
needs, and the params its model and recipe never read. From these:

* a model that cannot be built with the trial's params, or a recipe that cannot be used,
  fails the trial, with its error;
* a trial whose model needs more memory than any worker has fails too, before anything
  allocates it. The least it needs to train one member (its parameters, their gradients,
  the state its optimizer keeps with the trial's settings, and its buffers:
  ``fusion.sizing.MemberBytes``) is held against the workers' memory budget
  (``FUSETUNE_WORKER_MEMORY_BYTES``), else the largest worker's memory (CPU workers share
  their node's equally) less the headroom sizing keeps free. An unbounded width in a
  tenant's search space would otherwise have a worker allocate it until the node ran out of
  memory, and Ray's memory monitor then kills whichever worker it picks, another tenant's
  among them. The same floor caps how many members an array of the class gets
  (``Throughput.size_cap``);
* a param that neither the model factory nor the training recipe reads tunes nothing (a typo
  in the space): the trial names it in its user attr ``unused_params`` and the study gets a
  warning.

A registered workload is the service's own code: its trials are described as they are asked,
on the meta device, in the asking transaction (``asking.py``). A tenant's code package is
described by its describer (``packages.py``), in the package's own time, and the loop does
not wait for it: a factory that takes seconds per model would otherwise hold every tenant's
scheduling while it ran. Its trials are written WAITING with no signature, which no round
dispatches (``dispatch.py``); once the asking transaction has committed their params go to
the describer (:meth:`Descriptions.send`), and each step takes up the answers that have come
(:meth:`Descriptions.settle`; the answer's arrival wakes the loop). A study is not asked
again while its trials are being described, so a describer holds one call per study at a
time. Trials asked before the package has loaded in its describer (a client-driven study's
first enqueues) are held until it has: setting up its env is not a call's time. A call that
has not answered ``FUSETUNE_PACKAGE_CALL_TIMEOUT_S`` after it was sent, or raised, died or
answered with what the service does not decode, fails its study, and only it. The rows are
the record: trials left undescribed by an earlier process are described again at the first
step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from optuna.trial import TrialState as OptunaState
from pydantic import ConfigDict, TypeAdapter, ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from fusetune.fusion.sizing import HEADROOM
from fusetune.server import events
from fusetune.server.db import Study, StudyState, Trial, TrialState, utcnow
from fusetune.server.loop.context import LoopContext
from fusetune.server.loop.lifecycle import Lifecycle
from fusetune.server.loop.notices import StudyWarnings
from fusetune.server.loop.thread import database_unavailable
from fusetune.server.loop.throughput import Throughput
from fusetune.server.mirror import StudyMirror
from fusetune.workers.describer import Described
from fusetune.workers.package import PackageError

__all__ = ["UNUSED_ATTR", "Descriptions", "Undescribed"]

log = logging.getLogger(__name__)

#: The trial user attr that names the params nothing reads.
UNUSED_ATTR = "unused_params"


@dataclass(frozen=True)
class Undescribed:
    """An asked trial of a package study whose describer has not answered yet."""

    trial_id: int  #: fusetune's id
    optuna_trial_id: int
    params: Mapping[str, Any]


@dataclass
class _Call:
    """One describe call in flight: its answer, when it was sent, and the trials it describes."""

    ref: ray.ObjectRef
    since: float
    trials: list[Undescribed]


class Descriptions:
    """Judges described trials and follows the describe calls in flight (see the module docstring)."""

    def __init__(self, ctx: LoopContext, lifecycle: Lifecycle, notices: StudyWarnings, throughput: Throughput) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.lifecycle = lifecycle
        self.notices = notices
        self.throughput = throughput
        self._calls: dict[int, list[_Call]] = {}  # study id -> its calls in flight, oldest first
        # Study id -> trials to send once the package has loaded (setting its env up is not a
        # call's time): a client-driven study's first enqueues, and what an earlier process
        # asked and never had described.
        self._unsent: dict[int, list[Undescribed]] = {}
        self._recovered = False

    # -- judging ------------------------------------------------------------------------------------
    def judge(self, session: Session, mirror: StudyMirror, optuna_trial_id: int, described: Described, unused: set[str]) -> tuple[str, str | None]:
        """A described trial's signature and the error that fails it (None: it may train).

        A failed trial is told FAIL on the study's mirror; a trial with unused params names
        them in its user attrs, and they are added to ``unused`` (for :meth:`warn_unused`).
        In the caller's transaction."""
        signature, error, names, least_bytes = described
        error = error or self._too_large(signature, least_bytes)
        if error is not None:  # the workload's model rejected these params, or no worker fits it
            mirror.tell(session, optuna_trial_id, OptunaState.FAIL)
        elif names:
            mirror.set_user_attrs(session, optuna_trial_id, {UNUSED_ATTR: names})
            unused.update(names)
        return signature, error

    def warn_unused(self, session: Session, study_id: int, unused: Iterable[str]) -> None:
        """The study's warning that these params tune nothing (none: no warning)."""
        names = sorted(set(unused))
        if names:
            self.notices.add(session, study_id, [
                f"params {names} are read by neither the model factory nor the training recipe: they tune "
                f"nothing (a typo in the search space?); each trial names them in its user attr {UNUSED_ATTR!r}"
            ])

    def _too_large(self, signature: str, least_bytes: int) -> str | None:
        """Why a trial whose member needs ``least_bytes`` to train cannot train anywhere, or
        None; a class that fits has its arrays capped by it (see the module docstring)."""
        budget = self.settings.worker_memory_bytes
        workers = self.ctx.pool.workers
        if budget is not None:
            limit, whose = budget, "the workers' memory budget (FUSETUNE_WORKER_MEMORY_BYTES)"
        elif workers:
            limit = int(max(w.memory_bytes for w in workers) * (1 - HEADROOM))
            whose = f"the largest worker's memory less the {HEADROOM:.0%} that sizing keeps free"
        else:
            return None  # no worker yet: nothing to hold it against
        if least_bytes <= limit:
            self.throughput.note_least_bytes(signature, least_bytes)
            return None
        return (f"its model needs at least {_gib(least_bytes)} to train one member (its parameters, their "
                f"gradients, its optimizer's state and its buffers, before any activation), more than "
                f"{whose}, {_gib(limit)}: no worker can train it")

    # -- a package's describer, in its own time -----------------------------------------------------
    def describing(self, study_id: int) -> bool:
        """Whether some of the study's trials wait for their description."""
        return study_id in self._calls or study_id in self._unsent

    def send(self, study: Study, trials: Sequence[Undescribed]) -> None:
        """Send these trials of a package study (committed, WAITING, no signature) to its
        describer; until the package has loaded there (a client-driven study's first enqueue),
        they are held, and sent by :meth:`settle` once it has: setting up its env is not the call's time."""
        if not trials:
            return
        try:
            ready = self.ctx.packages.ready(study)
        except PackageError:
            ready = False  # settle fails the study, with the reason
        if not ready:
            self._unsent.setdefault(study.id, []).extend(trials)
            return
        ref = self.ctx.packages.describe(study, [dict(t.params) for t in trials], study.config.training)
        self._calls.setdefault(study.id, []).append(_Call(ref, time.monotonic(), list(trials)))
        # The loop sleeps until a worker speaks or its poll is due: the answer wakes it.
        ref.future().add_done_callback(lambda _: self.ctx.wake())

    def settle(self, session: Session) -> None:
        """Take up the describers' answers that have come: each trial gets its signature (it
        may be dispatched now) or fails; a describer that failed, or overran its time, fails its
        study. Trials an earlier process left undescribed are sent again first."""
        if not self._recovered:  # an enqueue may have come before this first step: not twice
            known = {t.trial_id for calls in self._calls.values() for call in calls for t in call.trials}
            known |= {t.trial_id for held in self._unsent.values() for t in held}
            for study_id, trials in self._undescribed(session).items():
                self._unsent.setdefault(study_id, []).extend(t for t in trials if t.trial_id not in known)
            self._recovered = True
        for study_id in list(self._unsent):
            self._send_held(session, study_id)
        for study_id in list(self._calls):
            study = session.get(Study, study_id)
            if study is None or study.state not in (StudyState.RUNNING, StudyState.PAUSED):
                del self._calls[study_id]  # its waiting trials were ended with it: nothing to describe
                continue
            calls = self._calls[study_id]
            while calls and self._settle_first(session, study, calls):
                calls.pop(0)
            if not calls:
                self._calls.pop(study_id, None)

    def _settle_first(self, session: Session, study: Study, calls: list[_Call]) -> bool:
        """Take up the study's oldest call in flight if it has answered; whether it has. A
        describer's failure (or its answer's) fails the study; the database's stops the step."""
        try:
            answers = self.ctx.packages.described(study, calls[0].ref, calls[0].since)
            if answers is None:
                return False  # not yet: its later calls queue behind it in the describer
            self._apply(session, study, calls[0].trials, answers)
            session.commit()
            return True
        except Exception as exc:
            session.rollback()
            self.notices.rolled_back()
            self.ctx.mirrors.drop(study.id)  # what it told the mirror was not written: read it again
            if database_unavailable(exc):
                raise
            calls.clear()
            reason = str(exc) if isinstance(exc, PackageError) else f"{type(exc).__name__}: {exc}"
            self.lifecycle.fail(session, study, f"describing its trials failed: {reason}")
            return False

    def _apply(self, session: Session, study: Study, trials: Sequence[Undescribed], answers: Any) -> None:
        """Write the describer's answers on the trials still waiting for them."""
        answers = _checked(answers, trials)
        still = set(session.scalars(select(Trial.id).where(
            Trial.id.in_([t.trial_id for t in trials]), Trial.state == TrialState.WAITING, Trial.signature == "",
        )))
        mirror = self.ctx.mirrors.of(study)
        unused: set[str] = set()
        described_rows: list[dict[str, Any]] = []
        failed_rows: list[dict[str, Any]] = []
        for trial, described in zip(trials, answers, strict=True):
            if trial.trial_id not in still:
                continue  # ended meanwhile (its study paused and cancelled, ...)
            signature, error = self.judge(session, mirror, trial.optuna_trial_id, described, unused)
            if error is None:
                described_rows.append({"id": trial.trial_id, "signature": signature})
                continue
            failed_rows.append({"id": trial.trial_id, "signature": signature, "state": TrialState.FAIL, "error": error,
                                "completed_at": utcnow()})
            events.record(session, "trial.ended", tenant=study.tenant, study_id=study.id, trial_id=trial.trial_id,
                          state="FAIL", value=None, error=error)
        for changed in (described_rows, failed_rows):  # by primary key, one statement each
            if changed:
                session.execute(update(Trial), changed)
        self.warn_unused(session, study.id, unused)

    @staticmethod
    def _undescribed(session: Session) -> dict[int, list[Undescribed]]:
        """What an earlier process asked and never had described, by study (its rows: waiting,
        no signature, in a running or paused study of a package)."""
        found = session.execute(
            select(Trial.study_id, Trial.id, Trial.optuna_trial_id, Trial.params)
            .join(Study, Trial.study_id == Study.id)
            .where(Study.state.in_((StudyState.RUNNING, StudyState.PAUSED)), Study.package.is_not(None),
                   Trial.state == TrialState.WAITING, Trial.signature == "")
            .order_by(Trial.id)
        ).all()
        by_study: dict[int, list[Undescribed]] = {}
        for study_id, trial_id, optuna_trial_id, params in found:
            by_study.setdefault(study_id, []).append(Undescribed(trial_id, optuna_trial_id, params))
        return by_study

    def _send_held(self, session: Session, study_id: int) -> None:
        """Send a study's held trials, once its package has loaded."""
        study = session.get(Study, study_id)
        if study is None or study.state not in (StudyState.RUNNING, StudyState.PAUSED):
            del self._unsent[study_id]
            return
        try:
            if not self.ctx.packages.ready(study):
                return
        except PackageError as exc:
            del self._unsent[study_id]
            self.lifecycle.fail(session, study, str(exc))
            return
        self.send(study, self._unsent.pop(study_id))


#: What a describer's answer is, checked before anything reads it: its classes are the
#: protocol's (workers/untrusted.py), but their shapes and sizes are the tenant's code's.
_ANSWERS = TypeAdapter(list[tuple[str, str | None, list[str], int]], config=ConfigDict(strict=True))
_MAX_SIGNATURE = 256
_MAX_ERROR = 16_384


def _checked(answers: Any, trials: Sequence[Undescribed]) -> list[Described]:
    """A describer's answers as the loop may use them, or PackageError saying what is wrong.

    Types are checked strictly (a nested list where a name belongs fails at once, before
    anything walks it), an error is cut to 16 KiB, and the unused params are names of the
    trial's own params, each once: a list that repeats one object many times over costs its
    sender a few bytes and the JSON written from it everything.
    """
    try:
        checked = _ANSWERS.validate_python(answers)
    except ValidationError as exc:
        raise PackageError(f"its describer answered what is not a list of descriptions: {exc.errors()[0]['msg']}") from None
    if len(checked) != len(trials):
        raise PackageError(f"its describer answered {len(checked)} descriptions for {len(trials)} trials")
    out: list[Described] = []
    for (signature, error, names, least_bytes), trial in zip(checked, trials, strict=True):
        if len(signature) > _MAX_SIGNATURE or least_bytes < 0:
            raise PackageError(f"its describer answered a signature of {len(signature)} characters, or "
                               f"{least_bytes} bytes: not a description")
        unused = sorted(set(trial.params) & set(names))
        out.append((signature, None if error is None else error[:_MAX_ERROR], unused, least_bytes))
    return out


def _gib(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):,.1f} MiB"
