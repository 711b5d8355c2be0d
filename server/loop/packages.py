"""The loop's side of tenants' code packages: their runtime envs and their describers.

A study of an uploaded workload (``Study.package``, a digest) never runs its code here. Its
arrays train in workers started in the package's Ray ``runtime_env``
(:meth:`PackageRuntime.env`, handed to ``WorkerPool.submit``), and what the loop needs of its
models (trial signatures, the params that change them, the params nothing reads, a memory
model) comes from the package's describer, a Ray actor in the same env
(``workers/describer.py``), in plain data.

A study is not asked until its describer has loaded the package (:meth:`ready`): setting up
the env (fetching the zip, installing requirements) takes what it takes, and the loop goes on
with every other study meanwhile. Idle workers that no other running study needs start in
the package's env as well (:meth:`PackageRuntime.warm`), so the describer's setup and the
workers' overlap, rather than the first array waiting for a worker restarted only then. A
package whose env or code fails there fails its study, with the traceback, and nothing else.
Once ready, each call waits at most
``package_call_timeout_s`` (a describer that hangs fails its study, not the loop).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from fusetune.server import packages
from fusetune.server.db import Study
from fusetune.server.schemas import parse_search_space
from fusetune.server.settings import Settings
from fusetune.workers import untrusted
from fusetune.workers.describer import Described, PackageDescriber
from fusetune.workers.package import PackageError
from fusetune.workers.pool import WorkerHandle, WorkerPool
from fusetune.workers.spec import TrainingSpec

__all__ = ["PackageRuntime"]

log = logging.getLogger(__name__)

#: The most of a describer's message the loop keeps (the rest is the tenant's to read in its logs).
_MAX_MESSAGE = 16_384
#: Non-fusible answers a describer keeps, by search space (one per study that got ready).
_SPACES_KEPT = 64


class _Describer:
    """One package's describer actor and its first call, the package's check."""

    def __init__(self, digest: str, env: dict[str, Any]) -> None:
        # Any: Ray types .remote() of a class as its ActorProxy, whose methods mypy reads as plain.
        actor: Any = ray.remote(PackageDescriber).options(num_cpus=0, runtime_env=env).remote(digest)
        self.actor = actor
        self.checked: ray.ObjectRef = self.actor.check.remote()  # the package loads (or its traceback)
        self.since = time.monotonic()
        self.ok = False
        self.inflight = 0  # describe calls sent and not yet taken up: it is not evicted meanwhile
        # (study space) -> its non_fusible call, sent as the study got ready, and when.
        self.non_fusible: dict[str, tuple[ray.ObjectRef, float]] = {}


class PackageRuntime:
    """Runtime envs and describers of the packages the running studies use (see the module docstring)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._describers: OrderedDict[str, _Describer] = OrderedDict()  # least recently used first

    def env(self, digest: str) -> dict[str, Any]:
        """The runtime env of a worker that runs the package (its zip put where Ray fetches it)."""
        return packages.runtime_env(self.settings, digest)

    def _describer(self, digest: str, *, wait: bool = False) -> _Describer | None:
        """The package's describer, started if need be. Past ``package_describers`` the least
        recently used idle one is stopped; one that is loading or answering never is, and with
        ``wait`` (a study getting ready) none is started over the limit: None, try again later."""
        found = self._describers.get(digest)
        if found is None:
            idle = [d for d, describer in self._describers.items() if self._idle(describer)]
            over = len(self._describers) + 1 - self.settings.package_describers
            if wait and over > len(idle):
                return None
            for old in idle[: max(0, over)]:
                ray.kill(self._describers.pop(old).actor, no_restart=True)
            found = self._describers[digest] = _Describer(digest, self.env(digest))
        self._describers.move_to_end(digest)
        return found

    @staticmethod
    def _idle(describer: _Describer) -> bool:
        """Loaded, and no answer of it awaited (a describe call, the non-fusible probes)."""
        if not describer.ok or describer.inflight:
            return False
        pending = [ref for ref, _ in describer.non_fusible.values()]
        return not pending or len(ray.wait(pending, num_returns=len(pending), timeout=0)[0]) == len(pending)

    def _existing(self, digest: str) -> _Describer:
        found = self._describer(digest)
        assert found is not None  # started whatever the limit: a call needs it now
        return found

    def ready(self, study: Study) -> bool:
        """Whether the study's package has loaded in its describer (True for a registered workload).

        Raises:
            PackageError: its env could not be set up, or its code failed to load (the traceback).
        """
        if study.package is None:
            return True
        describer = self._describer(study.package, wait=True)
        if describer is None:
            return False  # every describer is busy: a place frees as one loads or answers
        if not describer.ok:
            done, _ = ray.wait([describer.checked], timeout=0)
            if not done:
                if time.monotonic() - describer.since > self.settings.package_load_timeout_s:
                    self._forget(study.package)
                    raise PackageError(f"its code package {study.package[:12]} did not load in "
                                       f"{self.settings.package_load_timeout_s:.0f} s (FUSETUNE_PACKAGE_LOAD_TIMEOUT_S)")
                return False
            self._get(study.package, describer.checked, "load its workload")
            describer.ok = True
        if not study.config.fusion_sampler or not study.search_space or study.driver == "client":
            return True  # no FusionSampler here (mirrors.study_sampler)
        # FusionSampler's non-fusible params, found once per space while the loop goes on.
        space = json.dumps(study.search_space, sort_keys=True)
        if space not in describer.non_fusible:
            if len(describer.non_fusible) >= _SPACES_KEPT:  # the mirrors keep the answers they took
                describer.non_fusible.pop(next(iter(describer.non_fusible)))
            ref = describer.actor.non_fusible.remote(dict(parse_search_space(study.search_space)))
            describer.non_fusible[space] = (ref, time.monotonic())
        ref, since = describer.non_fusible[space]
        return self._answered(study.package, ref, since, "find its non-fusible params")

    def warm(self, pool: WorkerPool, studies: Sequence[Study]) -> list[WorkerHandle]:
        """Start idle workers in the env of each running study's package whose describer is
        still loading it, so that the package's first arrays find their workers up.

        Each of those packages may take as many idle workers as its studies have trials, from
        the workers that no other running study's code needs: one in the service's own code
        stays there while a study of a registered workload runs, one in another package's env
        while a study of that package runs. Returns the workers restarted.
        """
        loading = {d for d, describer in self._describers.items() if not describer.ok}
        wanted: dict[str, int] = {}
        for study in studies:
            if study.package in loading:
                wanted[study.package] = wanted.get(study.package, 0) + study.n_trials
        if not wanted:
            return []
        needed = {s.package for s in studies if s.package not in loading}  # None: the service's own code
        for worker in pool.workers:  # workers already in a loading package's env count toward it
            if worker.package in wanted:
                wanted[worker.package] -= 1
        free = [w for w in pool.idle() if w.package not in needed and w.package not in wanted]
        restarted = []
        for digest, count in wanted.items():
            for worker in free[: max(0, count)]:
                pool.prepare(worker, digest, self.env(digest))
                restarted.append(worker)
            free = free[max(0, count):]
        if restarted:
            log.info("%d idle workers start in the env of the code packages being loaded", len(restarted))
        return restarted

    def describe(self, study: Study, params: Sequence[Mapping[str, Any]], training: TrainingSpec | None) -> ray.ObjectRef:
        """Send trials to be described (``PackageDescriber.describe``): read the answer with :meth:`described`."""
        assert study.package is not None
        describer = self._existing(study.package)
        describer.inflight += 1
        ref: ray.ObjectRef = describer.actor.describe.remote([dict(p) for p in params], training)
        return ref

    def described(self, study: Study, ref: ray.ObjectRef, since: float) -> list[Described] | None:
        """The answer of a :meth:`describe` call sent at ``since``: each trial's signature, error,
        unused params and memory floor; None while the describer works on it.

        Raises:
            PackageError: it failed, or has not answered in ``package_call_timeout_s``.
        """
        assert study.package is not None
        if not self._answered(study.package, ref, since, "describe its trials"):
            return None
        describer = self._describers.get(study.package)
        if describer is not None:
            describer.inflight -= 1
        return list(self._get(study.package, ref, "describe its trials"))

    def non_fusible(self, study: Study, distributions: Mapping[str, Any]) -> frozenset[str]:
        """The params of the study's space that change its trials' signatures: the answer found
        while the study got ready, or (a study asked before this process knew it) found now.

        Raises:
            ValueError: no probe of the space built a model (as ``non_fusible_params``).
        """
        assert study.package is not None
        describer = self._existing(study.package)
        sent = describer.non_fusible.get(json.dumps(study.search_space, sort_keys=True))
        ref = sent[0] if sent is not None else describer.actor.non_fusible.remote(dict(distributions))
        found = self._get(study.package, ref, "find its non-fusible params")
        if isinstance(found, str):
            raise ValueError(found[:_MAX_MESSAGE])
        if not isinstance(found, frozenset) or not all(isinstance(name, str) for name in found):
            raise PackageError(f"its code package {study.package[:12]}'s describer answered what is not a set of param names")
        return frozenset(found) & frozenset(distributions)  # the space's own names, whatever else it sent

    def measure_memory(self, study: Study, params: dict[str, Any], training: TrainingSpec) -> ray.ObjectRef:
        """Start measuring the memory model of an array of these params' class (read with
        ``WorkerPool.measured``)."""
        assert study.package is not None
        return self._existing(study.package).actor.memory_model.remote(params, training)

    def _answered(self, digest: str, ref: ray.ObjectRef, since: float, doing: str) -> bool:
        """Whether a call sent at ``since`` has answered (PackageError once it is overdue)."""
        if ray.wait([ref], timeout=0)[0]:
            return True
        if time.monotonic() - since > self.settings.package_call_timeout_s:
            self._forget(digest)
            raise self._overdue(digest, doing)
        return False

    def _overdue(self, digest: str, doing: str) -> PackageError:
        return PackageError(f"its code package {digest[:12]} did not {doing} in {self.settings.package_call_timeout_s:.0f} s "
                            "(FUSETUNE_PACKAGE_CALL_TIMEOUT_S)")

    def _get(self, digest: str, ref: ray.ObjectRef, doing: str) -> Any:
        timeout = self.settings.package_call_timeout_s
        try:
            return untrusted.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            self._forget(digest)
            raise self._overdue(digest, doing) from None
        except ray.exceptions.RuntimeEnvSetupError as exc:
            self._forget(digest)
            raise PackageError(f"its code package {digest[:12]}'s runtime environment could not be set up: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            raise PackageError(f"its code package {digest[:12]} failed to {doing}: {cause}") from None
        except ray.exceptions.RayActorError as exc:
            self._forget(digest)
            raise PackageError(f"its code package {digest[:12]}'s describer died: {exc}") from None
        except ray.exceptions.RaySystemError as exc:  # it sent what this process does not decode
            self._forget(digest)
            raise PackageError(f"its code package {digest[:12]}'s describer answered with what the service "
                               f"does not decode (workers/untrusted.py): {exc}") from None
        except ray.exceptions.RayError as exc:  # an error whose cause it does not decode, as its text
            raise PackageError(f"its code package {digest[:12]} failed to {doing}: {exc}") from None

    def _forget(self, digest: str) -> None:
        describer = self._describers.pop(digest, None)
        if describer is not None:
            ray.kill(describer.actor, no_restart=True)

    def shutdown(self) -> None:
        for digest in list(self._describers):
            self._forget(digest)
