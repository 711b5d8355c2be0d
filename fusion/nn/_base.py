"""Base class shared by every fused twin of a ``torch.nn`` layer."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Self

import torch
from torch import nn

from .._errors import FusionError
from ._batched_call import FoldPlan, call_folded, in_batched_call

# Attributes every nn.Module carries that say nothing about a layer's configuration.
_IGNORED_ATTRS = frozenset({"training", "dump_patches", "call_super_init"})


def plain_config(module: nn.Module, ignore: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Return the public plain-valued attributes that configure ``module``.

    Two members can only share one fused layer when everything that shapes the
    computation (strides, eps, negative slopes, ...) is equal; parameters and
    buffers are compared separately by shape.
    """
    out: dict[str, Any] = {}
    for key, value in vars(module).items():
        if key.startswith("_") or key in _IGNORED_ATTRS or key in ignore:
            continue
        if value is None or isinstance(value, (bool, int, float, str, tuple, list)):
            out[key] = value
    return out


def check_same_config(
    members: Sequence[nn.Module], path: str, ignore: frozenset[str] = frozenset()
) -> None:
    """Raise :class:`FusionError` unless all ``members`` are configured alike."""
    first = plain_config(members[0], ignore)
    for b, m in enumerate(members[1:], start=1):
        other = plain_config(m, ignore)
        for key in sorted(set(first) | set(other)):
            if first.get(key) != other.get(key):
                raise FusionError(
                    f"submodule '{path or '<root>'}' ({type(members[0]).__name__}): attribute "
                    f"'{key}' differs between member 0 ({first.get(key)!r}) and member {b} "
                    f"({other.get(key)!r}); only parameters, buffers and per-member settings "
                    "may differ"
                )


def stack_param(tensors: Sequence[Any], requires_grad: bool = True) -> nn.Parameter | None:
    """Stack one optional parameter of every member into a ``[B, ...]`` parameter."""
    if tensors[0] is None:
        return None
    stacked = torch.stack([t.detach() for t in tensors]).clone()
    return nn.Parameter(stacked, requires_grad=requires_grad and tensors[0].requires_grad)


def stack_buffer(tensors: Sequence[Any]) -> torch.Tensor | None:
    """Stack one buffer of every member into a ``[B, ...]`` tensor."""
    if tensors[0] is None:
        return None
    return torch.stack([t.detach() for t in tensors]).clone()


# Member-major tensor id -> (weak reference to it, its version, its channel-major twin, B).
_CHANNEL_MAJOR: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor, int]] = {}


def remember_channel_major(member_major: torch.Tensor, channel_major: torch.Tensor, b: int) -> None:
    """Record that ``member_major`` (``[B*N, C, *S]``) was made from ``channel_major`` (``[N, B*C, *S]``).

    Fused convolutions and batch norms compute in the channel-major layout and return
    the member-major one (a copy). When the next layer is another of them, it takes the
    channel-major tensor back from here instead of copying the layout once more (and its
    backward skips both copies' backward too). The record lives as long as
    ``member_major`` and is ignored once that is modified in place.
    """
    if torch._C._are_functorch_transforms_active():
        return
    key = id(member_major)

    def forget(_ref: Any, key: int = key) -> None:
        _CHANNEL_MAJOR.pop(key, None)

    _CHANNEL_MAJOR[key] = (weakref.ref(member_major, forget), member_major._version, channel_major, b)


def recall_channel_major(member_major: torch.Tensor, b: int) -> torch.Tensor | None:
    """The channel-major twin of ``member_major`` from :func:`remember_channel_major`, if any."""
    entry = _CHANNEL_MAJOR.get(id(member_major))
    if entry is None or torch._C._are_functorch_transforms_active():
        return None
    ref, version, channel_major, members = entry
    if ref() is not member_major or member_major._version != version or members != b:
        return None
    return channel_major


class FusedLayer(nn.Module):
    """A layer holding the parameters of B members stacked along a leading axis.

    Inputs reach a fused layer with the member axis folded into the batch axis
    (member-major: rows ``b*N .. (b+1)*N-1`` belong to member ``b``), so every
    parameter-free operation between fused layers runs unchanged. Every
    parameter and buffer of a fused layer has the member axis first; that
    invariant is what lets :class:`fusion.FusedModel` export, remove and add
    members generically.
    """

    #: Axis of the layer's main input that holds the folded ``B*N`` batch.
    #: Layers that are applied to feature-last tensors (Linear, LayerNorm,
    #: Embedding, Dropout) learn it from a dry run; see ``needs_batch_probe``.
    batch_dim: int = 0
    #: Whether :class:`fusion.FusedModel` must find ``batch_dim`` by a dry run.
    needs_batch_probe: ClassVar[bool] = False
    #: Plain attributes allowed to differ between members (held per member, one list each).
    per_member_attrs: ClassVar[frozenset[str]] = frozenset()
    #: Whether, inside a batched module, a call runs folded (:mod:`fusion.nn._batched_call`).
    folds_in_batched_call: ClassVar[bool] = True
    #: Whether the layer treats an unbatched input as a batch of one, as its torch twin does
    #: (a member-dependent input without a batch axis can then be folded on a new axis).
    folds_unbatched: bool = False
    #: training flag -> how calls inside a batched module fold (None: run the plain layer).
    #: Set by the dry run of :class:`fusion.FusedModel`.
    fold_plans: Mapping[bool, FoldPlan | None] = MappingProxyType({})

    def __init__(self, num_members: int) -> None:
        super().__init__()
        self.num_members = num_members

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Inside a batched module's vmapped forward, this layer's tensors are one member's:
        # fold the members back together and run the fused forward for all of them at once.
        if in_batched_call() and self.folds_in_batched_call:
            return call_folded(self, args, kwargs)
        return super().__call__(*args, **kwargs)

    @property
    def plain(self) -> nn.Module:
        """The unfused ``torch.nn`` module this layer fuses (member 0's copy, kept by the fused model)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            raise FusionError(f"{type(self).__name__} has no plain twin attached")
        return plain

    def attach_plain(self, module: nn.Module) -> None:
        """Keep ``module`` (not registered as a submodule) as this layer's plain twin."""
        object.__setattr__(self, "_plain", module)

    def member_config(self, b: int) -> dict[str, Any]:
        """Member ``b``'s values of the per-member plain attributes (``per_member_attrs``)."""
        return {attr: getattr(self, attr)[b] for attr in self.per_member_attrs}

    #: The ``torch.nn`` layer type(s) this twin fuses (``from_members`` checks it).
    twin_of: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = ()
    #: Parameters and buffers the default ``from_members`` stacks per member (None stays None).
    stacked_params: ClassVar[tuple[str, ...]] = ()
    stacked_buffers: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Self:
        """Build the fused twin of ``members`` (same type); ``path`` is for messages.

        Members must agree on every plain attribute but ``per_member_attrs``; the twin is
        constructed from member 0 (``cls(B, members[0])``) and ``stacked_params`` and
        ``stacked_buffers`` are stacked along a new leading member axis.
        """
        first = members[0]
        if not cls.twin_of or not isinstance(first, cls.twin_of):
            raise FusionError(f"{cls.__name__} cannot be built from {type(first).__name__} members")
        check_same_config(members, path, ignore=cls.per_member_attrs)
        layer = cls(len(members), first)  # type: ignore[call-arg]
        for name in cls.stacked_params:
            setattr(layer, name, stack_param([getattr(m, name) for m in members]))
        for name in cls.stacked_buffers:
            layer.register_buffer(name, stack_buffer([getattr(m, name) for m in members]))
        return layer

    # Hooks for per-member state that is not a tensor (for example dropout p).
    def select_members(self, index: list[int]) -> None:
        """Keep only members ``index`` in non-tensor per-member state."""
        self.num_members = len(index)

    def append_members(self, other: FusedLayer) -> None:
        """Append the members of ``other`` (same twin type) to non-tensor state."""
        self.num_members += other.num_members

    def _to_front(self, x: torch.Tensor) -> torch.Tensor:
        """Move the folded batch axis of ``x`` to the front."""
        return x if self.batch_dim == 0 else x.movedim(self.batch_dim, 0)

    def _from_front(self, x: torch.Tensor) -> torch.Tensor:
        """Undo :meth:`_to_front`."""
        return x if self.batch_dim == 0 else x.movedim(0, self.batch_dim)

    def _check_batch(self, x: torch.Tensor, dim: int = 0) -> int:
        """Return the per-member batch size N of ``x`` along ``dim``."""
        rows = x.shape[dim]
        if rows % self.num_members:
            raise FusionError(
                f"{type(self).__name__}: input batch axis {dim} has {rows} rows, which is not a "
                f"multiple of the {self.num_members} members"
            )
        return rows // self.num_members

    def extra_repr(self) -> str:
        return f"num_members={self.num_members}"
