"""Base class of fused optimizers: per-member hyper-parameters and state."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch.optim import Optimizer

from .._errors import FusionError
from .._imports import import_torch_dynamo

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def expand_member_value(name: str, value: Any, b: int, pair: bool = False) -> list[Any]:
    """Expand a scalar (or a pair, for ``pair=True``) to B values; check lengths.

    Raises ``ValueError`` naming the hyper-parameter for a wrong-length list.
    """
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if pair:
        if isinstance(value, (list, tuple)) and len(value) == 2 and not isinstance(value[0], (list, tuple)):
            return [tuple(float(v) for v in value)] * b
        if isinstance(value, (list, tuple)):
            if len(value) != b or not all(isinstance(v, (list, tuple)) and len(v) == 2 for v in value):
                raise ValueError(
                    f"{name}: expected a pair or a sequence of {b} pairs (one per member), got {value!r}"
                )
            return [tuple(float(x) for x in v) for v in value]
        raise ValueError(f"{name}: expected a pair or a sequence of {b} pairs, got {value!r}")
    if isinstance(value, (list, tuple)):
        if len(value) != b:
            raise ValueError(
                f"{name}: expected a scalar or a sequence of length {b} (one per member), "
                f"got length {len(value)}"
            )
        return [float(v) for v in value]
    return [float(value)] * b


class FusedOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` over fused parameters ``[B, ...]``.

    Each name in ``member_hparams`` is stored in every param group as a list
    of B floats (``pair_hparams``: B pairs), so the group stays picklable and
    ``state_dict``/``load_state_dict`` work unchanged. Per-member state
    tensors have the member axis first, like the parameters; step counters
    are ``[B]`` tensors because members added later start at step 0.
    """

    member_hparams: ClassVar[tuple[str, ...]] = ("lr",)
    pair_hparams: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def state_tensors(cls, settings: Mapping[str, Any]) -> int:
        """How many tensors of state, each the size of the parameter, the optimizer keeps per
        parameter of a member trained with ``settings`` (its arguments by torch's names; one
        left out is at its default): what a memory floor of training counts
        (:class:`fusion.sizing.MemberBytes`)."""
        return 0

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        import_torch_dynamo()  # before torch.optim imports it from inside this call's callers
        params = list(params)
        self.num_members = self._infer_members(params)
        # Hyper-parameter tensors: _hp's keyed by value, _per_member's by (group, name).
        self._hp_cache: dict[tuple[Any, ...], Any] = {}
        super().__init__(params, defaults)

    @staticmethod
    def _infer_members(params: list[Any]) -> int:
        for item in params:
            tensors = item["params"] if isinstance(item, dict) else [item]
            if isinstance(tensors, torch.Tensor):
                tensors = [tensors]
            for t in tensors:
                if t.dim() < 1:
                    raise FusionError("fused optimizers need fused parameters with a member axis")
                return int(t.shape[0])
        raise ValueError("optimizer got an empty parameter list")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        b = self.num_members
        params = param_group["params"]
        tensors = [params] if isinstance(params, torch.Tensor) else list(params)
        for t in tensors:
            if t.dim() < 1 or t.shape[0] != b:
                raise FusionError(
                    f"parameter of shape {tuple(t.shape)} has no leading member axis of size {b}"
                )
        for key in self.member_hparams:
            value = param_group.get(key, self.defaults.get(key))
            param_group[key] = expand_member_value(key, value, b)
        for key in self.pair_hparams:
            value = param_group.get(key, self.defaults.get(key))
            param_group[key] = expand_member_value(key, value, b, pair=True)
        for key, value in self.defaults.items():
            param_group.setdefault(key, value)
        self._validate_group(param_group)
        super().add_param_group(param_group)

    #: Per-member hyper-parameters that must be >= 0 (checked like the torch twin does).
    nonnegative_hparams: ClassVar[tuple[str, ...]] = ()

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check value ranges like the torch twin does (per member)."""
        for key in self.nonnegative_hparams:
            for v in group[key]:
                if v < 0.0:
                    raise ValueError(f"Invalid {key} value: {v}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``. Setting gradients to None skips torch's
        profiler annotation when no profiler records (it costs several times the loop)."""
        if not set_to_none or torch.autograd._profiler_enabled():
            super().zero_grad(set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def _invalidate(self) -> None:
        """Drop what is derived from the members and their state (membership or state changed)."""
        self._hp_cache.clear()
        self.__dict__.pop("_settled_params", None)
        self.__dict__.pop("_host_step_counts", None)

    def _settled(self) -> dict[int, tuple[torch.Tensor, int]]:
        """Parameter id -> (its per-member step counter tensor, that tensor's version) for
        parameters whose counters were found all non-zero.

        Steps only count up, so a parameter stays settled as long as its counter tensor is
        the same and changed only by the optimizer's own increments; anything else (a
        membership or state change, :class:`fusion.amp.GradScaler` restoring a skipped
        member's state) shows in the tensor's version and makes it be checked again.
        """
        return self.__dict__.setdefault("_settled_params", {})

    def _count_steps(self, params: list[torch.Tensor], steps: list[torch.Tensor]) -> list[tuple[float, ...]]:
        """Per parameter, its per-member step counts (the values of ``steps``, just incremented).

        A host-side copy is counted up along with the tensors, so that they are read back
        (a device sync on an accelerator) only when something else changed them: their
        version then differs from the one after the last increment. Parameters with equal
        counts share one tuple object.
        """
        host = self._host_steps()
        canon: dict[tuple[float, ...], tuple[float, ...]] = {}
        bumped: dict[int, tuple[float, ...]] = {}
        out = []
        for p, t in zip(params, steps):
            entry = host.get(id(p))
            before = entry[2] if entry is not None and entry[0] is t and entry[1] + 1 == t._version else None
            now = None if before is None else bumped.get(id(before))
            if now is None:
                now = tuple(t.tolist()) if before is None else tuple(c + 1 for c in before)
                now = canon.setdefault(now, now)
                if before is not None:
                    bumped[id(before)] = now
            host[id(p)] = (t, t._version, now)
            out.append(now)
        return out

    def _host_steps(self) -> dict[int, tuple[torch.Tensor, int, tuple[float, ...]]]:
        """Parameter id -> (its step tensor, that tensor's version, host copy of its counts)."""
        return self.__dict__.setdefault("_host_step_counts", {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``; also drops what was derived from the old state."""
        self._invalidate()
        super().load_state_dict(state_dict)
        groups = state_dict["param_groups"]
        if groups:
            self.num_members = len(groups[0]["lr"])

    # ------------------------------------------------------------------ helpers
    def _hp(self, values: Sequence[float], like: torch.Tensor, cache: bool = True) -> torch.Tensor:
        """``values`` as a tensor broadcastable against ``like`` (member axis first).

        Hyper-parameters change rarely, so their tensors are cached; values that
        change every step (bias corrections) pass ``cache=False``.
        """
        if not cache:
            t = torch.tensor(list(values), dtype=like.dtype, device=like.device)
            return t.view(-1, *([1] * (like.dim() - 1)))
        key = (tuple(values), like.dtype, like.device, like.dim())
        cached = self._hp_cache.get(key)
        if cached is not None:
            return cached
        if len(self._hp_cache) > 4096:
            self._hp_cache.clear()
        t = torch.tensor(list(values), dtype=like.dtype, device=like.device)
        t = t.view(-1, *([1] * (like.dim() - 1)))
        self._hp_cache[key] = t
        return t

    def _per_member(
        self, group: dict[str, Any], name: str, values: Sequence[float], tensors: list[torch.Tensor],
        cache: bool = True,
    ) -> float | list[torch.Tensor]:
        """``values`` (one per member) as the scalar operand of ``torch._foreach_*`` ops over ``tensors``.

        A float when every member has the same value (torch's own scalar arithmetic),
        else, per tensor, a ``[B, 1, ...]`` view of one ``[B]`` tensor that broadcasts
        along the member axis. The tensor is cached under ``(group, name)`` together
        with the values it holds and rebuilt when they differ, so edits of a group's
        lists (by the user or a scheduler, in place or not) always take effect and
        unchanged values cost no allocation; ``cache=False`` for values that change
        every step.
        """
        first = values[0]
        if values.count(first) == len(values):
            return float(first)
        like = tensors[0]
        layout = (like.dtype, like.device, tuple(t.dim() for t in tensors))
        key = (id(group), name)
        vals = tuple(values)
        entry = self._hp_cache.get(key) if cache else None
        if entry is not None and entry[1] == layout and entry[0] == vals:
            return entry[2]
        vec = torch.tensor(vals, dtype=like.dtype, device=like.device)
        by_dim: dict[int, torch.Tensor] = {}
        views = []
        for d in layout[2]:
            view = by_dim.get(d)
            if view is None:
                view = by_dim[d] = vec.view(-1, *([1] * (d - 1)))
            views.append(view)
        if cache:
            self._hp_cache[key] = (vals, layout, views)
        return views

    #: Whether steps take the batched path: each operation of the update is one
    #: ``torch._foreach_*`` call over all parameters of a group, with per-member
    #: hyper-parameters broadcast along the member axis (and torch's fused kernel,
    #: one call for the group, where all members share every value). The
    #: per-parameter tensor-math path is the fallback (sparse gradients, mixed
    #: devices or dtypes); tests switch this off to check both.
    use_fused_kernels: bool = True

    def _can_batch(self, params: list[torch.Tensor]) -> bool:
        """Whether ``params`` (all with gradients) can take the batched path."""
        if not self.use_fused_kernels:
            return False
        first = params[0]
        return all(
            p.device == first.device and p.dtype == first.dtype and p.grad is not None
            and p.grad.layout == torch.strided and p.grad.dtype == p.dtype
            for p in params
        )

    def _can_use_fused_kernel(self, params: list[torch.Tensor]) -> bool:
        """Whether torch's fused optimizer kernels cover ``params`` (after :meth:`_can_batch`)."""
        first = params[0]
        return first.device.type in ("cpu", "cuda") and first.dtype in _FUSED_DTYPES

    def _new_step(self, p: torch.Tensor) -> torch.Tensor:
        """Per-member step counters: float32 like torch's, on the parameter's device
        (torch's fused kernels read them there)."""
        return torch.zeros(self.num_members, dtype=torch.float32, device=p.device)

    # ------------------------------------------------------------------ membership
    def remove_members(self, indices: Sequence[int]) -> None:
        """Drop members ``indices`` from hyper-parameters and state.

        Call together with :meth:`fusion.FusedModel.remove_members`.
        """
        drop = {int(i) for i in indices}
        keep = [i for i in range(self.num_members) if i not in drop]
        if not keep or any(not 0 <= i < self.num_members for i in drop):
            raise FusionError(f"invalid member indices {sorted(drop)} for {self.num_members} members")
        for group in self.param_groups:
            for key in self._per_member_keys(group):
                group[key] = [group[key][i] for i in keep]
        for state in self.state.values():
            for k, v in list(state.items()):
                if isinstance(v, torch.Tensor) and v.dim() >= 1:
                    state[k] = v.index_select(0, torch.tensor(keep, device=v.device))
        self.num_members = len(keep)
        self._invalidate()
        # Per-member views and schedulers (fusion.lr_scheduler) follow the removal.
        views = self.__dict__.get("_scheduler_views")
        if views is not None:
            self.__dict__["_scheduler_views"] = [views[i] for i in keep if i < len(views)]
        for ref in list(self.__dict__.get("_membership_listeners", [])):
            listener = ref()
            if listener is not None:
                listener(keep)

    def add_members(self, count: int = 1, **hparams: Any) -> None:
        """Append ``count`` new members with fresh state.

        Hyper-parameters of the new members are given as keywords (a scalar
        or a sequence of ``count``); unspecified ones take the constructor
        defaults. Call after :meth:`fusion.FusedModel.add_members`.
        """
        if count < 1:
            raise FusionError("add_members needs count >= 1")
        unknown = set(hparams) - set(self.member_hparams) - set(self.pair_hparams)
        if unknown:
            raise FusionError(f"unknown per-member hyper-parameters {sorted(unknown)}")
        for group in self.param_groups:
            new: dict[str, list[Any]] = {}
            for key in self.member_hparams:
                new[key] = expand_member_value(key, hparams.get(key, self.defaults[key]), count)
            for key in self.pair_hparams:
                new[key] = expand_member_value(key, hparams.get(key, self.defaults[key]), count, pair=True)
            self._validate_group({**group, **new})
            for key, values in new.items():
                group[key] = list(group[key]) + values
            # Schedulers record these; a new member starts from its own lr.
            if "initial_lr" in group:
                group["initial_lr"] = list(group["initial_lr"]) + new["lr"]
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                for k, v in list(state.items()):
                    if isinstance(v, torch.Tensor) and v.dim() >= 1:
                        fresh = self._fresh_state(k, v, count, new)
                        state[k] = torch.cat([v, fresh])
        self.num_members += count
        self._invalidate()

    # ------------------------------------------------------------------ one member's state
    def member_state_dict(self, b: int) -> dict[str, Any]:
        """Member ``b``'s hyper-parameters and optimizer state, for a checkpoint.

        ``{"hparams": [per param group {name: value}], "state": [per parameter, in
        param-group order, {key: tensor}]}``; tensors are detached copies. With
        :meth:`load_member_state_dict` it lets a member leave one array and continue in
        another exactly where it was (moments, step counts, momentum buffers).
        """
        if not 0 <= b < self.num_members:
            raise IndexError(f"member index {b} out of range for {self.num_members} members")
        hparams = [{key: group[key][b] for key in self._per_member_keys(group)} for group in self.param_groups]
        state = [
            {k: v[b].detach().clone() for k, v in self.state.get(p, {}).items() if isinstance(v, torch.Tensor) and v.dim() >= 1}
            for group in self.param_groups
            for p in group["params"]
        ]
        return {"hparams": hparams, "state": state}

    def load_member_state_dict(self, b: int, member_state: dict[str, Any]) -> None:
        """Make member ``b`` continue from :meth:`member_state_dict`'s ``member_state``.

        Overwrites member ``b``'s hyper-parameters and its slice of every state tensor;
        state the other members do not have yet (created lazily at their first step) is
        created for all, at its initial value for them.
        """
        if not 0 <= b < self.num_members:
            raise IndexError(f"member index {b} out of range for {self.num_members} members")
        params = [p for group in self.param_groups for p in group["params"]]
        if len(member_state["state"]) != len(params) or len(member_state["hparams"]) != len(self.param_groups):
            raise FusionError(
                f"member state has {len(member_state['hparams'])} param groups and {len(member_state['state'])} "
                f"parameters; this optimizer has {len(self.param_groups)} and {len(params)}"
            )
        for group, values in zip(self.param_groups, member_state["hparams"]):
            for key, value in values.items():
                if key not in group:
                    raise FusionError(f"unknown per-member hyper-parameter {key!r} in member state")
                group[key] = list(group[key])
                group[key][b] = tuple(value) if key in self.pair_hparams else value
            self._validate_group(group)
        for p, saved in zip(params, member_state["state"]):
            state = self.state[p]
            for k, v in saved.items():
                current = state.get(k)
                if current is None:  # lazily created state starts at zero for every optimizer here
                    current = state[k] = torch.zeros((self.num_members, *v.shape), dtype=v.dtype, device=p.device)
                current[b].copy_(v.to(current.device, current.dtype))
        self._invalidate()

    def add_membership_listener(self, method: Any) -> None:
        """Call bound ``method(keep)`` after :meth:`remove_members` (held weakly)."""
        self.__dict__.setdefault("_membership_listeners", []).append(weakref.WeakMethod(method))

    def _per_member_keys(self, group: dict[str, Any]) -> list[str]:
        keys = list(self.member_hparams) + list(self.pair_hparams)
        if "initial_lr" in group:
            keys.append("initial_lr")
        return keys

    def _fresh_state(self, key: str, value: torch.Tensor, count: int, new: dict[str, list[Any]]) -> torch.Tensor:
        """State of ``count`` new members for entry ``key`` (zeros by default)."""
        return torch.zeros((count, *value.shape[1:]), dtype=value.dtype, device=value.device)


def closure_loss(closure: Any) -> Any:
    """Re-evaluate the loss with ``closure`` (grad enabled), as ``torch.optim`` steps do."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def grads_of(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``params``, which a step takes only with one (``p.grad is not None``)."""
    grads = []
    for p in params:
        assert p.grad is not None
        grads.append(p.grad)
    return grads
