"""A module holding other tensors than its own for one call.

``torch.func.functional_call`` does this too, but puts the module's own tensors back
unchanged: a forward that reassigns a buffer (``self.ema = 0.9 * self.ema + 0.1 * x``
rather than an in-place update) would lose that update. :func:`holding` copies such
buffers into the tensors it was given (a member's rows of a stacked buffer, through vmap's
view of it), so the batched path and the per-member loop keep every member's buffers
exactly as separate models would. Fused twins inside batched modules use the same places
(:func:`slots`) to hold the members' physical tensors one vmap level down.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

#: (owner module, name, is a parameter, qualified name) of one place a module holds a tensor.
Slot = tuple[nn.Module, str, bool, str]


def slots(module: nn.Module) -> list[Slot]:
    """Every place ``module`` and its submodules hold a parameter or buffer (a tied parameter
    at each of its places). Cached: the places never change, only what they hold."""
    found = module.__dict__.get("_holding_slots")
    if found is None:
        found = []
        for prefix, owner in module.named_modules():
            for name, t in owner._parameters.items():
                if t is not None:
                    found.append((owner, name, True, f"{prefix}.{name}" if prefix else name))
            for name, t in owner._buffers.items():
                if t is not None:
                    found.append((owner, name, False, f"{prefix}.{name}" if prefix else name))
        module.__dict__["_holding_slots"] = found
    return found


def held(slot: Slot) -> torch.Tensor:
    """What the place holds now."""
    owner, name, is_param, _ = slot
    return owner._parameters[name] if is_param else owner._buffers[name]  # type: ignore[return-value]


def hold(slot: Slot, t: torch.Tensor) -> None:
    """Put ``t`` at the place (as functional_call does: into the module's own dicts)."""
    owner, name, is_param, _ = slot
    (owner._parameters if is_param else owner._buffers)[name] = t  # type: ignore[assignment]


def names(module: nn.Module) -> list[str]:
    """For each of :func:`slots`, the name ``state_of`` gives its tensor (a tied parameter has
    the name of its first place, as in ``named_parameters``). Cached: ties never change."""
    found = module.__dict__.get("_holding_names")
    if found is None:
        first: dict[int, str] = {}
        found = [first.setdefault(id(held(s)), s[3]) for s in slots(module)]
        module.__dict__["_holding_names"] = found
    return found


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer ``module`` holds, by name, tied parameters once: what
    ``named_parameters`` and ``named_buffers`` give, without walking the modules again."""
    return {name: held(s) for s, name in zip(slots(module), names(module))}


@contextmanager
def holding(module: nn.Module, state: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``module`` holds ``state`` (by the names of :func:`state_of`; a tied parameter at
    every place it is tied) while the block runs. Buffers the block reassigned are copied
    into the tensors of ``state`` when it ends."""
    places = slots(module)
    own = [held(s) for s in places]
    given = [state[name] for name in names(module)]
    for s, t in zip(places, given):
        hold(s, t)
    try:
        yield
        with torch.no_grad():
            for s, t in zip(places, given):
                if not s[2] and held(s) is not t:
                    t.copy_(held(s))
    finally:
        for s, t in zip(places, own):
            hold(s, t)
