"""Training a model that fuses by neither path: one member, as its plain model.

The fusion engine fuses what its twins and its batched path (``torch.func.vmap``, else a
loop over members) can run. A model neither can (its fused forward raises, or the per-member
loop cannot run it either) still trains: the control plane gives its class arrays of one
member, and :class:`Unfused` runs that member's own model, unchanged, behind the fused
model's interface, so the array's optimizer, checkpoints and reports are the fused ones'.
:func:`where_it_failed` names the module a fused model failed in, for the study's warning.
"""

from __future__ import annotations

import types
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["NotFused", "Unfused", "where_it_failed"]


class NotFused(Exception):
    """A fused model failed its first step or evaluation: fusion may be at fault.

    ``error`` is what it raised; whether the plain model trains decides (``workers.training``).
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class Unfused(nn.Module):
    """One member's own model with the interface of a fused model of one member.

    Its parameters are the model's, seen with a member axis of one (``[1, *shape]``, the
    same memory), so the fused optimizers, schedulers, clipping and their per-member
    checkpoints work on them unchanged. The model's forward runs as written, with those
    parameters (``torch.func.functional_call``) and its own buffers; inputs are
    ``[1, N, ...]`` and every tensor output gets the member axis back.
    """

    model: nn.Module

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        # Outside the module tree: parameters() are the member-axis views only.
        object.__setattr__(self, "model", model)
        named = list(model.named_parameters())  # a tied parameter once, under its first name
        self._names = [name for name, _ in named]
        self.stacked = nn.ParameterList(
            nn.Parameter(p.detach().unsqueeze(0), requires_grad=p.requires_grad) for _, p in named
        )

    @property
    def num_members(self) -> int:
        """Always one."""
        return 1

    def train(self, mode: bool = True) -> Unfused:
        super().train(mode)
        self.model.train(mode)
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model on member 0's inputs (``[1, N, ...]``); outputs ``[1, ...]``."""
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.squeeze(0), (args, kwargs))
        params = {name: p.squeeze(0) for name, p in zip(self._names, self.stacked, strict=True)}
        out = torch.func.functional_call(self.model, params, args, kwargs, strict=False, tie_weights=True)
        return pytree.tree_map_only(torch.Tensor, lambda t: t.unsqueeze(0), out)

    def member_state_dict(self, b: int) -> OrderedDict[str, torch.Tensor]:
        """The model's state dict (its parameters are the ones trained), detached copies."""
        self._check(b)
        return OrderedDict((k, v.detach().clone()) for k, v in self.model.state_dict().items())

    def member(self, b: int) -> nn.Module:
        """The model itself (metrics of the model only read it)."""
        self._check(b)
        return self.model

    def remove_members(self, indices: Sequence[int]) -> None:
        raise RuntimeError("an unfused array has one member: it ends with it")

    def add_members(self, models: Sequence[nn.Module]) -> None:
        # The control plane offers an array of one newcomers only where its member leaves.
        raise RuntimeError("an unfused array takes no members while its member trains")

    @staticmethod
    def _check(b: int) -> None:
        if b != 0:
            raise IndexError(f"member index {b} out of range for 1 member")


def where_it_failed(exc: BaseException, model: nn.Module) -> str:
    """How a study's warning names where ``exc`` came from in a fused copy of ``model``:
    ``submodule 'path' (Class)`` of the innermost module of ``model``'s classes whose code
    raised it (or raised what it wraps); else the model's class, with the innermost function
    of the model's own code it came through (an autograd Function's backward, say)."""
    paths: dict[type[nn.Module], str] = {}
    for path, module in model.named_modules():
        paths.setdefault(type(module), path)
    frames = list(_frames(exc))
    for frame in frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            # A fused model keeps a module's class as a base of the class it runs it as.
            for cls in type(owner).__mro__:
                if cls in paths:
                    return f"submodule '{paths[cls] or '<root>'}' ({cls.__name__})"
    own = [f for f in frames if _models_code(f)]
    return f"the model ({type(model).__name__})" + (f", in {own[0].f_code.co_qualname}" if own else "")


def _models_code(frame: types.FrameType) -> bool:
    """Whether ``frame`` runs code of the model's own (not torch's, fusion's or the worker's)."""
    name = str(frame.f_globals.get("__name__", ""))
    return name.split(".")[0] not in {"torch", "contextlib", "copy", "functools"} and not name.startswith(
        ("fusetune.fusion", "fusetune.workers")
    )


def _frames(exc: BaseException) -> Iterator[types.FrameType]:
    """The frames ``exc`` and what it wraps were raised through, innermost first."""
    seen: set[int] = set()
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    for error in reversed(chain):  # the innermost cause first
        frames = []
        tb = error.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        yield from reversed(frames)
