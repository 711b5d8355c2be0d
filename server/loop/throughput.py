"""What the scheduling loop has measured of each class's arrays: their speeds, the sizes that
ran out of memory, the memory models that size arrays to a budget, and each class's memory
floor per member (from its model built on the meta device when its trials were asked).

Speeds are models·steps/s by (signature, device type) and array size B, folded in as each
array-epoch reports (an exponential average, ``FUSETUNE_THROUGHPUT_SMOOTHING``), written to
``ft_throughput`` with the epoch's transaction and read back by a later process, so a
restarted service or a second study of the same shapes sizes its arrays from what was
measured. The scheduler gets each class's speed-up curve fitted to those points.

A class whose model fuses by neither path (its fused model failed its first step while its
own model trains, ``ArrayOutcome.unfusible``) gets arrays of one member, trained unfused;
its study's system attr ``fusetune:unfusible`` keeps that for a restarted service.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.orm import Session

from fusetune.fusion.sizing import HEADROOM
from fusetune.scheduler import Scheduler, fit_points
from fusetune.server import mirror
from fusetune.server.db import Array, Study
from fusetune.server.loop import rows
from fusetune.server.loop.packages import PackageRuntime
from fusetune.server.settings import Settings
from fusetune.workers.pool import WorkerHandle, WorkerPool
from fusetune.workers.spec import ArrayOutcome, EpochReport, TrainingSpec

__all__ = ["UNFUSIBLE_ATTR", "Throughput"]

log = logging.getLogger(__name__)

#: The Optuna study system attr naming the study's classes that fuse by neither path:
#: signature -> why (what a restarted service sizes their arrays by).
UNFUSIBLE_ATTR = "fusetune:unfusible"


class Throughput:
    """Measured speeds, out-of-memory caps and memory models (see the module docstring)."""

    def __init__(self, settings: Settings, pool: WorkerPool, scheduler: Scheduler, packages: PackageRuntime) -> None:
        self.settings = settings
        self.pool = pool
        self.packages = packages
        self.scheduler = scheduler
        # Measured models·steps/s by (signature, device type) and B: ft_throughput, in memory.
        self.points: dict[tuple[str, str], dict[int, float]] = {}
        # Speeds observed in the transaction being written, written once each at its end:
        # (signature, device type, B) -> (smoothed rate, samples added, whether its row is new).
        self._observed: dict[tuple[str, str, int], tuple[float, int, bool]] = {}
        # Largest array of a class on a device type since an array of it ran out of memory there.
        self._oom_caps: dict[tuple[str, str], int] = {}
        self._memory_models: dict[str, tuple[int, int]] = {}  # signature -> (base, member) bytes
        self._memory_pending: dict[str, tuple[Any, float]] = {}  # signature -> (its measurement on a worker, since)
        # Classes whose model fuses by neither path -> why: their arrays train one member, unfused.
        self._unfusible: dict[str, str] = {}
        # signature -> the least bytes one member needs to train (asking's meta-device build):
        # known for the classes this process asked; a restarted service caps the classes it
        # asks again, and the memory budget's model caps every class.
        self._least_bytes: dict[str, int] = {}
        self._recalled: set[int] = set()  # studies whose stored unfusible classes are in _unfusible

    # -- speeds ----------------------------------------------------------------------------------
    def load(self, session: Session) -> None:
        """The speeds measured by earlier arrays, also by an earlier process: no new dry runs."""
        for row in rows.throughput(session):
            self.points.setdefault((row.signature, row.device_type), {})[row.members] = row.models_steps_per_s

    def observe(self, cls: str, device_type: str, report: EpochReport, warm: bool) -> None:
        """Fold an array-epoch's measured speed into the class's curve; :meth:`write` writes it
        to ft_throughput."""
        signature = cls.split("@", 1)[0]
        measured = []
        if warm and report.train_seconds > 0 and report.size > 0:
            measured.append((report.size, report.member_steps / report.train_seconds))
        if report.solo_steps_per_s:
            measured.append((1, report.solo_steps_per_s))
        if not measured:
            return
        points = self.points.setdefault((signature, device_type), {})
        smoothing = self.settings.throughput_smoothing
        for members, rate in measured:
            key = (signature, device_type, members)
            _, samples, new = self._observed.get(key, (0.0, 0, members not in points))
            if members in points:
                rate = (1 - smoothing) * points[members] + smoothing * rate
            points[members] = rate
            self._observed[key] = (rate, samples + 1, new)
        self.scheduler.throughput.set_curve(cls, device_type, fit_points(points, self.settings.prior_marginal_cost))

    def write(self, session: Session) -> None:
        """Write the speeds :meth:`observe` folded in since the last call: one row each, however
        many of the transaction's array-epochs measured it."""
        observed, self._observed = self._observed, {}
        rows.write_throughput(session, observed)

    def rolled_back(self) -> None:
        """The transaction that was to write the observed speeds rolled back: points whose row
        was new are not there after all (a retry observes them again)."""
        for signature, device_type, members in [k for k, (_, _, new) in self._observed.items() if new]:
            del self.points[(signature, device_type)][members]
        self._observed.clear()

    def solo_known(self, signature: str, device_type: str) -> bool:
        """Whether the class's B = 1 speed is measured on this device type."""
        return 1 in self.points.get((signature, device_type), {})

    def curve_classes(self, classes: set[str], device_types: set[str]) -> None:
        """Give the scheduler each class's curve fitted to its signature's measured points."""
        for cls in classes:
            signature = cls.split("@", 1)[0]
            for device_type in device_types:
                points = self.points.get((signature, device_type))
                if points:
                    self.scheduler.throughput.set_curve(cls, device_type, fit_points(points, self.settings.prior_marginal_cost))

    # -- memory ----------------------------------------------------------------------------------
    def split_on_oom(self, session: Session, worker: WorkerHandle, array: Array, result: ArrayOutcome | BaseException) -> bool:
        """An array that ran out of memory with more than one member is split: True.

        Its class's arrays on this device type are capped at half its size from now on,
        and its members wait again, to train in the halves (from their checkpoints).
        """
        if not isinstance(result, ArrayOutcome) or not result.oom:
            return False
        running = rows.count_running_in(session, array.id)
        if running < 2:
            return False  # one member alone does not fit: it fails with the error
        key = (f"{array.signature}@{array.study_id}", worker.device_type)
        self._oom_caps[key] = min(self._oom_caps.get(key, running), max(1, running // 2))
        log.warning("array %d ran out of memory with %d members: retrying in arrays of %d", array.id, running, self._oom_caps[key])
        return True

    # -- fusion ----------------------------------------------------------------------------------
    def unfusible(self, cls: str) -> str | None:
        """Why the class's model fuses by neither path (its arrays train one member, unfused);
        None: it fuses, as far as is known."""
        return self._unfusible.get(cls)

    def recall_unfusible(self, study: Study, stored: Callable[[], Mapping[str, Any]]) -> None:
        """The classes of ``study`` found unfusible before, also by an earlier process: from its
        system attrs, ``stored()``, read once per study and process."""
        if study.id in self._recalled:
            return
        self._recalled.add(study.id)
        found = stored().get(UNFUSIBLE_ATTR)
        for signature, why in (found.items() if isinstance(found, dict) else ()):
            self._unfusible.setdefault(f"{signature}@{study.id}", str(why))

    def unfuse(self, session: Session, array: Array, result: ArrayOutcome | BaseException) -> str | None:
        """An array whose fused model could not run while its members' own model trains: its
        class trains unfused from now on, in arrays of one, and its study's attr says so (in
        the caller's transaction). Why (naming the module), or None: it fused."""
        if not isinstance(result, ArrayOutcome) or result.unfusible is None:
            return None
        self._unfusible[f"{array.signature}@{array.study_id}"] = result.unfusible
        study = session.get(Study, array.study_id)
        if study is not None:
            classes = (cls.split("@", 1) for cls in self._unfusible)
            stored = {signature: self._unfusible[f"{signature}@{of}"] for signature, of in classes if of == str(study.id)}
            mirror.set_study_system_attr(session, study.optuna_study_id, UNFUSIBLE_ATTR, stored)
        log.warning("array %d: its model fuses by neither path: its class trains unfused (%s)", array.id, result.unfusible)
        return result.unfusible

    def size_cap(
        self, session: Session, cls: str, worker: WorkerHandle, trial_id: int, waiting: Mapping[int, tuple[Any, Study]],
    ) -> int:
        """The most members an array of ``cls`` may have on ``worker``: one for a model that fuses by
        neither path; half of the size that ran out of memory there; no more members than the
        worker's memory, less sizing's headroom, holds at a member's floor
        (:meth:`note_least_bytes`); and with a memory
        budget, what the fusion engine's memory model fits in it. 0 while that model is being
        measured on a worker (:meth:`memory_model`): start none yet."""
        if cls in self._unfusible:
            return 1  # one member, unfused: it fits if anything does
        cap = self._oom_caps.get((cls, worker.device_type), self.settings.max_array_size)
        least = self._least_bytes.get(cls)
        if least:  # B members need at least B times a member's floor, activations aside
            cap = max(1, min(cap, int(worker.memory_bytes * (1 - HEADROOM)) // least))
        budget = self.settings.worker_memory_bytes
        if budget is None:
            return cap
        trial, study = waiting[trial_id]
        model = self.memory_model(session, trial.signature, worker, trial_id, study)
        if model is None:
            return 0
        base, member = model
        return max(1, min(cap, (budget - base) // max(member, 1)))

    def note_least_bytes(self, signature: str, least_bytes: int) -> None:
        """Record the least bytes a member of ``signature`` needs to train (``Asker``): the most
        of its trials', since an array keeps the optimizer state any of its members needs for all."""
        if len(self._least_bytes) >= 65536 and signature not in self._least_bytes:
            self._least_bytes.clear()  # classes come and go: a bound, not an eviction policy
        self._least_bytes[signature] = max(least_bytes, self._least_bytes.get(signature, 0))

    def memory_model(self, session: Session, signature: str, worker: WorkerHandle, trial_id: int, study: Study) -> tuple[int, int] | None:
        """The memory model of ``signature``'s arrays, ``(base, member)`` bytes, measured on a
        worker (``workers/memory.py``): a tenant's model is never built or stepped in this
        process, which is also the API and the Ray driver. None while the measurement runs
        (asked of ``worker``, idle; polled each round). One that fails or outlasts
        ``FUSETUNE_RAY_TIMEOUT_S`` leaves the class one member per array, which fits if anything does."""
        if signature in self._memory_models:
            return self._memory_models[signature]
        pending = self._memory_pending.get(signature)
        if pending is None:
            training: TrainingSpec = study.config.training
            params = rows.params_of(session, trial_id)
            if study.package is not None:  # measured in the package's describer, where its code runs
                ref = self.packages.measure_memory(study, params, training)
            else:
                ref = self.pool.measure_memory(worker, study.workload, params, training)
            self._memory_pending[signature] = (ref, time.monotonic())
            return None
        ref, since = pending
        try:
            model = self.pool.measured(ref)
        except LookupError as exc:  # the worker died: measure again, on another
            log.warning("study %d: measuring its arrays' memory: %s; again", study.id, exc)
            del self._memory_pending[signature]
            return None
        except RuntimeError as exc:
            log.warning("study %d: no memory model for its arrays (%s): one member each", study.id, exc)
            model = (0, self.settings.worker_memory_bytes or 1)
        if model is None:
            if time.monotonic() - since < self.settings.ray_timeout_s:
                return None
            log.warning("study %d: its arrays' memory model took over %.0f s: one member each", study.id, self.settings.ray_timeout_s)
            model = (0, self.settings.worker_memory_bytes or 1)
        del self._memory_pending[signature]
        self._memory_models[signature] = model
        return model

