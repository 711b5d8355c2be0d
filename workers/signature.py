"""A trial's fusion key: the key that decides which trials may be fused into one array.

Shared by the control plane (which packs trials by it), the client's FusionSampler (which
samples the params that change it once per group) and the workers: it lives with the
workload protocol and the training recipe it reads.

**Shape signatures** (:func:`shape_signature`).

Two trials can be horizontally fused (HFTA) only if the fusion engine accepts their models
as members of one fused model, and the whole array shares the same array-wide settings
(batch size, optimizer type, epochs, ...) and parameter/buffer dtypes.  Which models the
engine accepts is decided by one rule that lives in the engine, :func:`fusion.layout` (per
submodule: class, parameter and buffer shapes, and every plain attribute members must
share); the signature hashes that layout rather than restating it, so trials with equal
digests are never packed into an array that ``fusion.fuse`` then refuses.  A
:class:`Signature` captures all of it, and its ``digest`` is the string the packer and the
scheduler group by.

Per-trial numeric hyper-parameters that the engine keeps per member are deliberately *not*
part of the signature: the learning rate, weight decay, ... of HFTA's fused optimizers, and
the module attributes fused twins hold per member (Dropout ``p``, BatchNorm ``momentum``),
which the layout leaves out.  Such trials still fuse.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from fusetune.fusion import layout as fusion_layout
from fusetune.fusion.sizing import MemberBytes
from fusetune.workers.optimization import OPTIMIZERS, resolve
from fusetune.workers.spec import TrainingSpec

if TYPE_CHECKING:
    from fusetune.workers.workloads import Workload

__all__ = [
    "Signature", "TrialModel", "array_settings", "canonical_json", "fusible_params", "shape_signature", "trial_model",
    "trial_signature", "unused_params",
]

_DIGEST_HEX_CHARS = 16  # 64 bits: collisions are negligible for the signatures one service sees


@dataclass(frozen=True)
class Signature:
    """Canonical description of a fusible model + its array-wide settings.

    Attributes:
        digest: short, stable hex SHA-256 of the canonical form; equal iff the rest is equal.
        layers: one entry per submodule in module order:
            ``(path, type_name, ((tensor_name, shape), ...))`` with parameters then buffers.
        settings: sorted ``(key, canonical_json_value)`` items of the array-wide settings.
        dtypes: ``(qualified_tensor_name, dtype)`` for every parameter and buffer.
        attrs: ``(path, ((attr, canonical_json_value), ...))``, sorted by attribute, for
            every module that has any: the attributes members must share according to
            :func:`fusion.layout` (conv stride, pooling kernel, ReLU ``inplace``, a user
            module's ``self.scale``, ...; not Dropout ``p`` or BatchNorm ``momentum``).
    """

    digest: str
    layers: tuple[tuple[str, str, tuple[tuple[str, tuple[int, ...]], ...]], ...]
    settings: tuple[tuple[str, str], ...]
    dtypes: tuple[tuple[str, str], ...] = ()
    attrs: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def __str__(self) -> str:
        return self.digest


def _canonical(value: Any) -> Any:
    """Map a settings value onto plain JSON types so that equal meanings serialise equally."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            # JSON has no NaN/inf; a tagged string keeps them distinct and stable.
            return {"__float__": repr(value)}
        if value.is_integer():
            # 32 and 32.0 mean the same batch size/epoch count; do not split arrays over it.
            return int(value)
        return value
    if isinstance(value, enum.Enum):
        return {"__enum__": f"{type(value).__qualname__}.{value.name}"}
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (set, frozenset)):
        items = [_canonical(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Size):
        return list(value)
    if isinstance(value, type) or callable(value):
        # Optimizer / loss classes and factory functions: identify them by qualified name.
        module = getattr(value, "__module__", "") or ""
        name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or repr(value)
        return {"__callable__": f"{module}.{name}"}
    return {"__repr__": repr(value)}


def canonical_json(value: Any) -> str:
    """Canonical, compact JSON of ``value`` (sorted keys), used for hashing and equality."""
    return json.dumps(_canonical(value), sort_keys=True, separators=(",", ":"), allow_nan=False)


def shape_signature(model: nn.Module, settings: Mapping[str, Any]) -> Signature:
    """Compute the fusion signature of ``model`` trained under array-wide ``settings``.

    ``model`` may live on any device, including ``meta`` (no memory is touched: only
    shapes, dtypes, module types and plain attributes are read).  ``settings`` holds every setting that must
    be identical across the members of one fused array (batch size, optimizer type,
    epochs, ...); values are canonicalised so that e.g. ``{"a": 1, "b": 2}`` and
    ``{"b": 2, "a": 1.0}`` give the same digest.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(settings, Mapping):
        raise TypeError(f"settings must be a Mapping, got {type(settings).__name__}")

    # The engine's rule, hashed as is: deriving the signature from it is what keeps
    # "equal digests" implying "fuse() accepts them".  It raises a ValueError
    # (FusionError) naming the tensor for a lazy, uninitialised model.
    entries = fusion_layout(model)
    layers = [(e.path, e.type_name, e.tensors) for e in entries]
    attrs = [(e.path, e.config) for e in entries if e.config]
    # Dtypes are the scheduler's own, stricter requirement: fuse() would promote mixed
    # members to one dtype, silently changing the precision some of them train in.
    dtypes: list[tuple[str, str]] = []
    for path, module in model.named_modules(remove_duplicate=False):
        for name, tensor in list(module.named_parameters(recurse=False)) + [
            (n, b) for n, b in module.named_buffers(recurse=False) if b is not None
        ]:
            dtypes.append((f"{path}.{name}" if path else name, str(tensor.dtype)))

    for key in settings:
        if not isinstance(key, str):
            raise TypeError(f"settings keys must be str, got {key!r}")
    settings_items = tuple(sorted((k, canonical_json(v)) for k, v in settings.items()))

    canonical = json.dumps(
        {
            "layers": [[p, t, [[n, list(s)] for n, s in ts]] for p, t, ts in layers],
            "dtypes": [list(d) for d in dtypes],
            "attrs": [[p, [list(a) for a in at]] for p, at in attrs],
            "settings": [list(s) for s in settings_items],
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:_DIGEST_HEX_CHARS]
    return Signature(
        digest=digest,
        layers=tuple(layers),
        settings=settings_items,
        dtypes=tuple(dtypes),
        attrs=tuple(attrs),
    )


def fusible_params(
    signature_fn: Callable[[Mapping[str, Any]], Signature],
    params: Mapping[str, Any],
    candidates: Mapping[str, Sequence[Any]],
) -> dict[str, bool]:
    """Derive which hyper-parameters are fusible from the signature itself.

    A parameter is fusible iff varying it over its candidate values, with every other
    parameter held at ``params``, never changes the signature digest: trials that differ
    only in fusible parameters can always share an array.  Nothing is declared by hand, so
    the answer cannot drift from what the packer actually does.
    """
    base = signature_fn(params).digest
    result: dict[str, bool] = {}
    for name, values in candidates.items():
        fusible = True
        for value in values:
            trial = dict(params)
            trial[name] = value
            if signature_fn(trial).digest != base:
                fusible = False
                break
        result[name] = fusible
    return result


# -- trial signatures: a workload's model at some params, memoised -------------------------------
# A trial's fusion key: the shape signature of its model plus the settings its array shares.
#
# Asking a batch of trials computes one signature per trial, on the scheduling loop, while
# the workers wait for their first arrays: building 64 digits MLPs on the meta device took
# ~80 ms of the ~170 ms from a study's POST to its first array on the 2-core machine. The
# model factory of a workload is a function of the params it reads (the same params give the
# same shapes), so a signature is memoised by exactly those: the params the factory read,
# with their values, recorded while it built the model. A batch that samples one width per
# group then builds one model per group, and a param the factory never reads (lr, momentum)
# cannot split the memo.



_ABSENT = object()  # a param the factory looked up and did not find (it used its default)
_Built = tuple[str, MemberBytes]  # a model's shape signature and its tensors' sizes
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
    """Trials' models already built, per (workload, array settings): ``(params read, (digest, sizes))`` pairs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[Any, str], list[tuple[tuple[tuple[str, Any], ...], _Built]]] = {}

    def get(self, key: tuple[Any, str], params: Mapping[str, Any]) -> _Built | None:
        with self._lock:
            entries = list(self._entries.get(key, ()))
        for read, built in entries:
            if all(_same(params.get(k, _ABSENT), v) for k, v in read):
                return built
        return None

    def put(self, key: tuple[Any, str], read: Mapping[str, Any], built: _Built) -> None:
        with self._lock:
            entries = self._entries.setdefault(key, [])
            if len(entries) >= _MAX_MEMO:
                entries.clear()
            entries.append((tuple(read.items()), built))


_memo = _Memo()


class TrialModel(NamedTuple):
    """What the control plane learns of a trial's model by building it on the meta device."""

    #: The trial's fusion key: its model's shape signature and its array settings.
    signature: str
    #: A floor of the bytes one member needs to train with the trial's optimizer and its
    #: settings (``fusion.sizing.MemberBytes``): a trial whose floor no worker has cannot train.
    least_bytes: int


def trial_signature(workload: Workload, params: Mapping[str, Any], training: TrainingSpec | None = None) -> str:
    """The shape signature of a trial's model, built on the meta device (no memory, no init cost).

    Memoised by the params the workload's ``build_model`` read (see the module docstring).
    """
    return _built(workload, params, training)[0]


def trial_model(workload: Workload, params: Mapping[str, Any], training: TrainingSpec | None = None) -> TrialModel:
    """A trial's signature and the least memory one of its members trains in (:class:`TrialModel`),
    from its model built on the meta device (memoised as :func:`trial_signature` is)."""
    digest, sizes = _built(workload, params, training)
    recipe = resolve(workload, training, params)
    optimizer = OPTIMIZERS[recipe.optimizer]
    return TrialModel(digest, sizes.least_to_train(optimizer, {**recipe.options, **recipe.hparams}))


def _built(workload: Workload, params: Mapping[str, Any], training: TrainingSpec | None) -> _Built:
    settings = array_settings(workload, params, training)
    # The factory itself, not the workload's name: a name registered again is another model.
    key = (workload.build_model, json.dumps(settings, sort_keys=True, default=repr))
    known = _memo.get(key, params)
    if known is not None:
        return known
    reads = _Reads(params)
    try:
        with torch.device("meta"):
            model = workload.build_model(reads)
    except Exception:
        # A factory that needs a real dict (``params.copy()``), or params it rejects: built
        # again from the params themselves, unmemoised, so its own error is the one raised.
        with torch.device("meta"):
            model = workload.build_model(params)
        return shape_signature(model, settings).digest, MemberBytes.of(model)
    built = shape_signature(model, settings).digest, MemberBytes.of(model)
    _memo.put(key, reads.read, built)
    return built


def unused_params(workload: Workload, params: Mapping[str, Any], training: TrainingSpec | None = None) -> list[str]:
    """The params of a trial that neither its model factory nor its training recipe reads.

    A search-space param that nothing reads (a typo, a knob the model lost) tunes nothing;
    the service names it on the study and the trial instead of ignoring it. The factory
    builds on the meta device with params that record what it looks up, and the recipe
    (``array_settings``: the optimizer, its hyper-parameters, the LR schedule, the batch
    size) records what it reads. A factory that iterates over the params has read them all;
    one that cannot build from a read-recording view reports nothing.
    """
    model_reads, recipe_reads = _Reads(params), _Reads(params)
    try:
        with torch.device("meta"):
            workload.build_model(model_reads)
        array_settings(workload, recipe_reads, training)
    except Exception:
        return []
    return sorted(set(params) - set(model_reads.read) - set(recipe_reads.read))
