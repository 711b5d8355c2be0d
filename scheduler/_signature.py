"""Shape signatures: the key that decides which trials may be fused into one array.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fusetune.fusion import layout as fusion_layout

__all__ = ["Signature", "shape_signature", "fusible_params", "canonical_json"]

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
