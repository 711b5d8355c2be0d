"""A trial's fusion key: the shape signature of its model plus the settings its array shares.

Asking a batch of trials computes one signature per trial, on the scheduling loop, while
the workers wait for their first arrays: building 64 digits MLPs on the meta device took
~80 ms of the ~170 ms from a study's POST to its first array on the 2-core machine. The
model factory of a workload is a function of the params it reads (the same params give the
same shapes), so a signature is memoised by exactly those: the params the factory read,
with their values, recorded while it built the model. A batch that samples one width per
group then builds one model per group, and a param the factory never reads (lr, momentum)
cannot split the memo.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fusetune.scheduler import shape_signature
from fusetune.workers.optimization import resolve
from fusetune.workers.spec import TrainingSpec
from fusetune.workers.workloads import Workload

__all__ = ["array_settings", "trial_signature"]

_ABSENT = object()  # a param the factory looked up and did not find (it used its default)
_MAX_MEMO = 4096  # entries kept per (workload, settings): a guard against unbounded spaces


def array_settings(workload: Workload, params: Mapping[str, Any], training: TrainingSpec | None = None) -> dict[str, Any]:
    """The settings every member of an array must share, beyond its operator shapes.

    The optimizer class and its array-wide flags, the LR scheduler class and AMP come from
    the trial's recipe (``workers.optimization.resolve``: its params, else the study's
    ``training`` settings, else the workload's), so trials with different optimizers never
    share an array. Raises ``OptionError`` naming the parameter a recipe cannot use.

    The study's epochs are not among them: an array holds one study's trials (the
    scheduler's class is the signature within a study), and what a signature keys beyond
    packing, the measured speed of its arrays, is the same for 5 epochs as for 50: a second
    study of the same model reuses it whatever its epochs.
    """
    return {
        "workload": workload.name,
        **resolve(workload, training, params).array_settings(),
        "batch_size": workload.batch_size_for(params),
    }


class _Reads(Mapping[str, Any]):
    """A read-only view of params that records what a model factory looked up.

    A factory that iterates over the params (``**params``, ``.items()``) has read all of them.
    """

    def __init__(self, params: Mapping[str, Any]) -> None:
        self._params = params
        self.read: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        try:
            value = self._params[key]
        except KeyError:
            self.read[key] = _ABSENT
            raise
        self.read[key] = value
        return value

    def __contains__(self, key: object) -> bool:
        found = key in self._params
        if isinstance(key, str):
            self.read[key] = self._params[key] if found else _ABSENT
        return found

    def __iter__(self) -> Iterator[str]:
        self.read.update(self._params)
        return iter(self._params)

    def __len__(self) -> int:
        self.read.update(self._params)
        return len(self._params)


def _same(a: Any, b: Any) -> bool:
    """Equal and of one type: 1, 1.0 and True are different reads for a factory that checks."""
    return a is b or (type(a) is type(b) and a == b)


class _Memo:
    """Signatures already built, per (workload, array settings): ``(params read, digest)`` pairs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[Any, str], list[tuple[tuple[tuple[str, Any], ...], str]]] = {}

    def get(self, key: tuple[Any, str], params: Mapping[str, Any]) -> str | None:
        with self._lock:
            entries = list(self._entries.get(key, ()))
        for read, digest in entries:
            if all(_same(params.get(k, _ABSENT), v) for k, v in read):
                return digest
        return None

    def put(self, key: tuple[Any, str], read: Mapping[str, Any], digest: str) -> None:
        with self._lock:
            entries = self._entries.setdefault(key, [])
            if len(entries) >= _MAX_MEMO:
                entries.clear()
            entries.append((tuple(read.items()), digest))


_memo = _Memo()


def trial_signature(workload: Workload, params: Mapping[str, Any], training: TrainingSpec | None = None) -> str:
    """The shape signature of a trial's model, built on the meta device (no memory, no init cost).

    Memoised by the params the workload's ``build_model`` read (see the module docstring).
    """
    settings = array_settings(workload, params, training)
    # The factory itself, not the workload's name: a name registered again is another model.
    key = (workload.build_model, json.dumps(settings, sort_keys=True, default=repr))
    digest = _memo.get(key, params)
    if digest is not None:
        return digest
    reads = _Reads(params)
    try:
        with torch.device("meta"):
            model = workload.build_model(reads)
    except Exception:
        # A factory that needs a real dict (``params.copy()``), or params it rejects: built
        # again from the params themselves, unmemoised, so its own error is the one raised.
        with torch.device("meta"):
            model = workload.build_model(params)
        return shape_signature(model, settings).digest
    digest = shape_signature(model, settings).digest
    _memo.put(key, reads.read, digest)
    return digest
