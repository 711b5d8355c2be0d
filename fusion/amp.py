"""Per-member gradient scaling for mixed-precision training of fused arrays.

One member's overflow must not cost the others their step: ``torch.amp.GradScaler``
skips the whole optimizer step when any gradient is non-finite, which in a
fused array would stall every member for one member's overflow. This scaler
keeps a loss scale, growth tracker and found-inf flag per member, skips only
the overflowing members' updates and adjusts each member's scale exactly as
``torch.amp.GradScaler`` would for that member alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._errors import FusionError
from .optim._base import FusedOptimizer, expand_member_value


class GradScaler:
    """Per-member twin of ``torch.amp.GradScaler`` for :mod:`fusion.optim` optimizers.

    Usage mirrors torch's: ``scaler.scale(losses).sum().backward()``,
    optionally ``scaler.unscale_(opt)`` before clipping, ``scaler.step(opt)``,
    ``scaler.update()``. ``init_scale`` may be one value or B values.
    """

    def __init__(
        self,
        num_members: int,
        init_scale: float | Sequence[float] = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not 0.0 < backoff_factor < 1.0 or growth_factor <= 1.0:
            raise ValueError("need 0 < backoff_factor < 1 < growth_factor")
        self.num_members = num_members
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.enabled = enabled
        # float32 like torch's scale, so scaled losses round identically.
        self._scale = torch.tensor(expand_member_value("init_scale", init_scale, num_members), dtype=torch.float32)
        self._growth_tracker = torch.zeros(num_members, dtype=torch.int32)
        self._found_inf: dict[int, torch.Tensor] = {}
        self._stepped: set[int] = set()

    # ------------------------------------------------------------------ scaling
    def scale(self, losses: torch.Tensor) -> torch.Tensor:
        """Multiply each member's loss (``Tensor[B]``) by its scale."""
        if not self.enabled:
            return losses
        if losses.shape[:1] != (self.num_members,):
            raise FusionError(f"scale expects per-member losses of shape [{self.num_members}, ...]")
        scale = self._scale.to(losses.device)
        return losses * scale.view(-1, *([1] * (losses.dim() - 1)))

    def _params(self, optimizer: FusedOptimizer) -> list[torch.Tensor]:
        return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def unscale_(self, optimizer: FusedOptimizer) -> None:
        """Divide each member's gradients by its scale and record which overflowed."""
        if not self.enabled:
            return
        key = id(optimizer)
        if key in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        params = self._params(optimizer)
        found = torch.zeros(self.num_members, dtype=torch.bool)
        if params:
            dev = params[0].device
            inv = self._scale.to(dev).double().reciprocal().float()
            found = found.to(dev)
            for p in params:
                g = p.grad
                assert g is not None  # _params keeps parameters with gradients only
                g.mul_(inv.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))
                found |= ~torch.isfinite(g.reshape(self.num_members, -1)).all(dim=1)
        self._found_inf[key] = found.cpu()

    def step(self, optimizer: FusedOptimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` for the members whose gradients are finite."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if not isinstance(optimizer, FusedOptimizer):
            raise FusionError("fusion.amp.GradScaler steps fusion.optim optimizers only")
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        if key not in self._found_inf:
            self.unscale_(optimizer)
        skip = [b for b, bad in enumerate(self._found_inf[key].tolist()) if bad]
        self._stepped.add(key)
        if not skip:
            return optimizer.step(*args, **kwargs)
        if len(skip) == self.num_members:
            return None
        saved = self._save_members(optimizer, skip)
        result = optimizer.step(*args, **kwargs)
        self._restore_members(optimizer, skip, saved)
        return result

    def _save_members(self, optimizer: FusedOptimizer, members: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the skipped members' slices of every parameter and state tensor."""
        index = torch.tensor(members)
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                saved.append((p, p.data.index_select(0, index.to(p.device))))
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.dim() >= 1:
                        saved.append((value, value.index_select(0, index.to(value.device))))
        return saved

    def _restore_members(self, optimizer: FusedOptimizer, members: list[int],
                         saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        restored = {id(t) for t, _ in saved}
        index = torch.tensor(members)
        for tensor, values in saved:
            with torch.no_grad():
                target = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
                target.index_copy_(0, index.to(target.device), values)
        # State the step created (a lazily built momentum buffer) starts over
        # for skipped members: zeros mean "never stepped" in fusion.optim.
        for group in optimizer.param_groups:
            for p in group["params"]:
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and value.dim() >= 1 and id(value) not in restored:
                        with torch.no_grad():
                            value.index_fill_(0, index.to(value.device), 0)

    # ------------------------------------------------------------------ update
    def update(self) -> None:
        """Back off the scale of members that overflowed, grow the others' on schedule."""
        if not self.enabled:
            return
        if not self._found_inf:
            raise RuntimeError("update() needs a step() or unscale_() since the last update()")
        found = torch.zeros(self.num_members, dtype=torch.bool)
        for f in self._found_inf.values():
            found |= f
        for b in range(self.num_members):
            # torch's own update kernel, applied to member b's scalars.
            torch._amp_update_scale_(
                self._scale[b : b + 1], self._growth_tracker[b : b + 1], found[b : b + 1].float(),
                self.growth_factor, self.backoff_factor, self.growth_interval,
            )
        self._found_inf.clear()
        self._stepped.clear()

    def get_scale(self) -> list[float]:
        """Current loss scale of each member."""
        return self._scale.tolist()

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale.clone(), "growth_tracker": self._growth_tracker.clone(),
            "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = state["scale"].clone()
        self._growth_tracker = state["growth_tracker"].clone()
        self.num_members = int(self._scale.shape[0])
        self.growth_factor = state["growth_factor"]
        self.backoff_factor = state["backoff_factor"]
        self.growth_interval = state["growth_interval"]

    # ------------------------------------------------------------------ membership
    def remove_members(self, indices: Sequence[int]) -> None:
        """Drop members (call with the model's and optimizer's remove_members)."""
        keep = [b for b in range(self.num_members) if b not in {int(i) for i in indices}]
        self._scale = self._scale[keep].clone()
        self._growth_tracker = self._growth_tracker[keep].clone()
        self.num_members = len(keep)

    def add_members(self, count: int = 1, init_scale: float | Sequence[float] = 2.0**16) -> None:
        """Append members with fresh scales."""
        extra = torch.tensor(expand_member_value("init_scale", init_scale, count), dtype=torch.float32)
        self._scale = torch.cat([self._scale, extra])
        self._growth_tracker = torch.cat([self._growth_tracker, torch.zeros(count, dtype=torch.int32)])
        self.num_members += count
