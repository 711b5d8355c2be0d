"""Shared harness of the fusion equivalence tests.

The reference is B separately built and trained copies (plain torch modules,
torch.optim optimizers and schedulers); the fused array must match them in
outputs, losses, gradients, parameters, buffers (BatchNorm statistics) and
optimizer state after every step, and in eval mode at the end.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fusetune.fusion as fusion


def tolerances(dtype: torch.dtype) -> float:
    """Relative tolerance: float64 1e-10, float32 1e-5."""
    return 1e-10 if dtype == torch.float64 else 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    """|actual - expected| <= rtol * (|expected| + max|expected|) + floor, elementwise.

    The error is relative to the element and to the tensor's scale: an
    element that is ~0 by cancellation (a logit near zero, a gradient entry
    of a deep net) carries the rounding error of the large terms it was
    computed from, so a purely elementwise relative bound would measure
    cancellation, not correctness. The small absolute floor (1e-12 / 1e-6)
    covers tensors that are zero in exact arithmetic (the gradient of a conv
    bias feeding BatchNorm is pure rounding noise).
    """
    rtol = tolerances(dtype)
    expected = expected.to(actual.dtype)
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=rtol * scale + (1e-12 if dtype == torch.float64 else 1e-6), msg=lambda m: f"{what}: {m}"
    )


def make_members(factory: Callable[[], nn.Module], b: int, dtype: torch.dtype, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [factory().to(dtype) for _ in range(b)]


def classification_batch(b: int, n: int, in_shape: Sequence[int], classes: int, dtype: torch.dtype,
                         shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if shared:
        x = fusion.broadcast(torch.randn(n, *in_shape, dtype=dtype), b)
        y = fusion.broadcast(torch.randint(0, classes, (n,)), b)
    else:
        x = torch.randn(b, n, *in_shape, dtype=dtype)
        y = torch.randint(0, classes, (b, n))
    return x, y


def compare_state(
    fused: fusion.FusedModel, refs: Sequence[nn.Module], dtype: torch.dtype, what: str,
    grads: bool = False, skip: Sequence[str] = (),
) -> None:
    fused_params = dict(fused.module.named_parameters())
    for b, ref in enumerate(refs):
        sd = fused.member_state_dict(b)
        ref_sd = ref.state_dict()
        assert sd.keys() == ref_sd.keys()
        for k, v in ref_sd.items():
            if k in skip:
                continue
            if v.is_floating_point():
                assert_close(sd[k], v, f"{what} member {b} {k}", dtype)
            else:
                assert torch.equal(sd[k], v), f"{what} member {b} {k}"
        if grads:
            for name, p in ref.named_parameters():
                fp = fused_params[name]
                if p.grad is None:
                    assert fp.grad is None or not fp.grad[b].any(), name
                    continue
                assert_close(fp.grad[b], p.grad, f"{what} member {b} grad {name}", dtype)


def compare_optimizer_state(fused_opt: torch.optim.Optimizer, ref_opts: Sequence[torch.optim.Optimizer],
                            fused: fusion.FusedModel, refs: Sequence[nn.Module], dtype: torch.dtype,
                            what: str, skip: Sequence[str] = (), skip_params: Sequence[str] = ()) -> None:
    fused_params = dict(fused.module.named_parameters())
    for b, (opt, ref) in enumerate(zip(ref_opts, refs)):
        for name, p in ref.named_parameters():
            if name in skip_params:
                continue
            ref_state = opt.state.get(p, {})
            fstate = fused_opt.state.get(fused_params[name], {})
            for key, value in ref_state.items():
                if key in skip or value is None:
                    continue
                assert key in fstate, f"{what}: missing optimizer state {key} for {name}"
                got = fstate[key][b]
                if key == "step":
                    assert float(got) == float(value), f"{what}: step of member {b}"
                else:
                    assert_close(got, value, f"{what} member {b} state {key} of {name}", dtype)


def run_equivalence(
    factory: Callable[[], nn.Module],
    make_batch: Callable[[int], tuple[Any, torch.Tensor]],
    make_ref_opt: Callable[[int, nn.Module], torch.optim.Optimizer],
    make_fused_opt: Callable[[fusion.FusedModel], torch.optim.Optimizer],
    *,
    b: int = 3,
    steps: int = 3,
    dtype: torch.dtype = torch.float64,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    make_ref_sched: Callable[[int, torch.optim.Optimizer], Any] | None = None,
    make_fused_sched: Callable[[torch.optim.Optimizer], Any] | None = None,
    sched_metric: bool = False,
    opt_state_skip: Sequence[str] = (),
    clip: Sequence[float] | None = None,
    zero_grad_params: Sequence[str] = (),
    fallback: bool = True,
    batched: Sequence[type[nn.Module]] = (),
) -> fusion.FusedModel:
    """Train B separate copies and the fused array side by side and compare.

    ``zero_grad_params`` names parameters whose true gradient is exactly zero
    (a conv bias feeding BatchNorm): their computed gradients are pure
    rounding noise (~1e-17), which adaptive optimizers divide by its own
    square root, so their updates are ratios of rounding errors and cannot be
    compared. Their gradients are still compared (to absolute tolerance).
    """
    members = make_members(factory, b, dtype)
    refs = [copy.deepcopy(m) for m in members]
    fused = fusion.fuse(members, fallback=fallback, batched=batched)
    # fuse copies; the originals must be untouched.
    for m, r in zip(members, refs):
        for (k, v), (_, w) in zip(m.state_dict().items(), r.state_dict().items()):
            assert torch.equal(v, w), k
    ref_opts = [make_ref_opt(i, r) for i, r in enumerate(refs)]
    fused_opt = make_fused_opt(fused)
    ref_scheds = [make_ref_sched(i, o) for i, o in enumerate(ref_opts)] if make_ref_sched else None
    fused_sched = make_fused_sched(fused_opt) if make_fused_sched else None
    fused.train()
    for r in refs:
        r.train()
    for step in range(steps):
        x, y = make_batch(b)
        xs = x if isinstance(x, tuple) else (x,)
        ref_losses = []
        ref_outs = []
        for i, (r, o) in enumerate(zip(refs, ref_opts)):
            o.zero_grad()
            out = r(*(t[i] for t in xs))
            loss = loss_fn(out, y[i])
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(r.parameters(), clip[i])
            ref_losses.append(loss.detach())
            ref_outs.append(out.detach())
        fused_opt.zero_grad()
        out = fused(*xs)
        losses = fusion.per_member_loss(loss_fn, out, y)
        losses.sum().backward()
        if clip is not None:
            fusion.clip_grad_norm_(fused.parameters(), clip)
        for i in range(b):
            assert_close(out[i].detach(), ref_outs[i], f"step {step} output {i}", dtype)
            assert_close(losses[i].detach(), ref_losses[i], f"step {step} loss {i}", dtype)
        compare_state(fused, refs, dtype, f"step {step} before update", grads=True, skip=zero_grad_params)
        for o in ref_opts:
            o.step()
        fused_opt.step()
        compare_state(fused, refs, dtype, f"step {step} after update", skip=zero_grad_params)
        compare_optimizer_state(fused_opt, ref_opts, fused, refs, dtype, f"step {step}", opt_state_skip,
                                zero_grad_params)
        if fused_sched is not None and ref_scheds is not None:
            if sched_metric:
                metrics = [float(loss) for loss in ref_losses]
                for s, mtr in zip(ref_scheds, metrics):
                    s.step(mtr)
                fused_sched.step(metrics)
            else:
                for s in ref_scheds:
                    s.step()
                fused_sched.step()
            for g, group in enumerate(fused_opt.param_groups):
                for i, o in enumerate(ref_opts):
                    assert abs(group["lr"][i] - o.param_groups[g]["lr"]) <= 1e-15 * max(1.0, abs(o.param_groups[g]["lr"])), (
                        f"step {step} lr of member {i}"
                    )
    fused.eval()
    for r in refs:
        r.eval()
    x, _ = make_batch(b)
    xs = x if isinstance(x, tuple) else (x,)
    with torch.no_grad():
        out = fused(*xs)
        for i, r in enumerate(refs):
            assert_close(out[i], r(*(t[i] for t in xs)), f"eval output {i}", dtype)
    compare_state(fused, refs, dtype, "after eval", skip=zero_grad_params)
    return fused


def optimizer_pair(torch_cls: Any, fused_cls: Any, per_member: dict, shared: dict | None = None) -> tuple[Any, Any]:
    """Factories of member i's torch optimizer and of the fused one with every member's values."""
    shared = shared or {}

    def ref(i: int, m: nn.Module) -> torch.optim.Optimizer:
        return torch_cls(m.parameters(), **{k: v[i] for k, v in per_member.items()}, **shared)

    def fused(f: nn.Module) -> torch.optim.Optimizer:
        return fused_cls(f.parameters(), **per_member, **shared)

    return ref, fused
