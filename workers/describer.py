"""What the control plane needs to know of a code package's models, answered where its code
may run.

The scheduling loop keys every trial by its model's shape signature, derives which params
change it (``FusionSampler``), finds the params nothing reads, and may size arrays by a
memory model. For a registered workload it does that in its own process. A tenant's code
package must never run there, so each package gets a :class:`PackageDescriber`: a Ray actor
in the package's ``runtime_env`` (``workers/package.py``) that holds no device (``num_cpus=0``:
it builds models on the meta device) and answers in plain data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fusetune.workers.memory import array_memory_model
from fusetune.workers.package import package_workload
from fusetune.workers.signature import trial_model, trial_signature, unused_params
from fusetune.workers.spec import TrainingSpec

__all__ = ["PackageDescriber", "Described"]

#: One trial as described: its signature ("" when its model could not be built), the error
#: that stopped it, the params that neither its model nor its recipe read, and the least
#: bytes one member needs to train (``TrialModel.least_bytes``; 0 when unbuilt).
Described = tuple[str, str | None, list[str], int]


class PackageDescriber:
    """Describes the models of one package's workload (wrapped in ``ray.remote`` by the loop)."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    def check(self) -> str:
        """Load the workload (:class:`~fusetune.workers.package.PackageError` with the traceback
        if its code fails); its name.

        The loop waits for this call without holding itself, but for the later ones it holds
        (``FUSETUNE_PACKAGE_CALL_TIMEOUT_S``): so what they import is imported here, not in
        the first of them (Optuna's samplers took seconds of a loaded machine's first call)."""
        import fusetune.workers.samplers  # noqa: F401 - non_fusible's import, made before it is timed

        return str(package_workload(self.digest).name)

    def describe(self, params: Sequence[Mapping[str, Any]], training: TrainingSpec | None) -> list[Described]:
        """Each trial's signature and memory floor (``workers.signature.trial_model``), or the
        error its model's factory raised, and its unused params."""
        workload = package_workload(self.digest)
        out: list[Described] = []
        for p in params:
            try:
                model = trial_model(workload, p, training)
            except Exception as exc:  # the workload's model rejected these params
                out.append(("", f"{type(exc).__name__}: {exc}", [], 0))
                continue
            out.append((model.signature, None, unused_params(workload, p, training), model.least_bytes))
        return out

    def non_fusible(self, distributions: Mapping[str, Any]) -> frozenset[str] | str:
        """The params of the space that change the signature (``non_fusible_params``), or why
        none could be found (no probe of the space built a model)."""
        from fusetune.workers.samplers import non_fusible_params

        workload = package_workload(self.digest)
        try:
            return non_fusible_params(workload, distributions=distributions, signature=lambda p: trial_signature(workload, p))
        except ValueError as exc:
            return str(exc)

    def memory_model(self, params: dict[str, Any], training: TrainingSpec) -> tuple[int, int]:
        """``(base, member)`` bytes of an array of these params' class (``workers.memory``)."""
        return array_memory_model(package_workload(self.digest), params, training)
