"""The batched steps of fused SGD and Adam against separate torch optimizers.

The batched path runs each operation of the update once for all parameters of a group
(``torch._foreach_*``), per-member values broadcast along the member axis, shared values
as scalars, and torch's fused kernel where every member shares every value. These tests
cover the cases that path special-cases: members without momentum among members with
it, members on their first step while others are not, parameters whose step counts
differ, hyper-parameters edited between steps, and which kernel runs when.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _fusion_helpers import assert_close, compare_optimizer_state, compare_state, run_equivalence
from _fusion_helpers import optimizer_pair as pair
from torch import nn

import fusetune.fusion as fusion

D = torch.float64


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 5))


def batch(b: int):
    return torch.randn(b, 6, 4, 4, dtype=D), torch.randint(0, 5, (b, 6))


SGD_CASES = {
    "mixed-momentum": (dict(lr=[0.1, 0.05, 0.2], momentum=[0.9, 0.0, 0.5], dampening=[0.0, 0.3, 0.2],
                            weight_decay=[0.0, 0.1, 0.01]), {}),
    "mixed-momentum-maximize": (dict(lr=[0.1, 0.05, 0.2], momentum=[0.0, 0.8, 0.5],
                                     weight_decay=[0.01, 0.0, 0.1]), dict(maximize=True)),
    "no-momentum": (dict(lr=[0.1, 0.05, 0.2], weight_decay=[0.01, 0.0, 0.1]), {}),
    "nesterov-maximize": (dict(lr=[0.1, 0.05, 0.2], momentum=[0.9, 0.5, 0.1], weight_decay=[0.0, 0.1, 0.01]),
                          dict(nesterov=True, maximize=True)),
    "shared-values": (dict(lr=[0.1] * 3, momentum=[0.9] * 3, weight_decay=[0.01] * 3), {}),
    "shared-momentum": (dict(lr=[0.1, 0.05, 0.2], momentum=[0.9] * 3, dampening=[0.1] * 3), {}),
}


@pytest.mark.parametrize("name", sorted(SGD_CASES))
def test_sgd_batched_matches_torch(name):
    per_member, shared = SGD_CASES[name]
    ref, fused = pair(torch.optim.SGD, fusion.optim.SGD, per_member, shared)
    run_equivalence(mlp, batch, ref, fused, b=3, steps=4)


ADAM_CASES = {
    "adam": (torch.optim.Adam, fusion.optim.Adam,
             dict(lr=[1e-2, 3e-3, 2e-2], weight_decay=[0.0, 0.1, 0.01], eps=[1e-8, 1e-6, 1e-7],
                  betas=[(0.9, 0.999), (0.5, 0.9), (0.8, 0.99)]), dict(maximize=True)),
    "adamw-amsgrad": (torch.optim.AdamW, fusion.optim.AdamW,
                      dict(lr=[1e-2, 3e-3, 2e-2], weight_decay=[0.0, 0.1, 0.5]), dict(amsgrad=True)),
    "adam-shared": (torch.optim.Adam, fusion.optim.Adam, dict(lr=[1e-2] * 3), {}),
}


@pytest.mark.parametrize("name", sorted(ADAM_CASES))
def test_adam_batched_matches_torch(name):
    torch_cls, fused_cls, per_member, shared = ADAM_CASES[name]
    ref, fused = pair(torch_cls, fused_cls, per_member, shared)
    run_equivalence(mlp, batch, ref, fused, b=3, steps=4)


def _train_side_by_side(fused, fopt, refs, ropts, steps, drop_grad=None):
    """``steps`` steps of the fused array and its references; ``drop_grad`` names a parameter
    whose gradient is discarded before the step (torch then leaves it and its state alone)."""
    for _ in range(steps):
        b = fused.num_members
        x, y = batch(b)
        fopt.zero_grad()
        fusion.per_member_loss(F.cross_entropy, fused(x), y).sum().backward()
        if drop_grad is not None:
            dict(fused.module.named_parameters())[drop_grad].grad = None
        fopt.step()
        for i, (r, o) in enumerate(zip(refs, ropts)):
            o.zero_grad()
            F.cross_entropy(r(x[i]), y[i]).backward()
            if drop_grad is not None:
                dict(r.named_parameters())[drop_grad].grad = None
            o.step()
        compare_state(fused, refs, D, "after step")
        compare_optimizer_state(fopt, ropts, fused, refs, D, "after step")


def _members(b: int, seed: int = 0) -> tuple[fusion.FusedModel, list[nn.Module]]:
    torch.manual_seed(seed)
    models = [mlp().to(D) for _ in range(b)]
    refs = [copy.deepcopy(m) for m in models]
    return fusion.fuse(models), refs


@pytest.mark.parametrize("maximize", [False, True])
def test_sgd_member_added_later_starts_its_momentum_like_torch(maximize):
    """A newcomer's momentum buffer starts as its first gradient (weight decay included)
    while the others' continue, members without momentum among them."""
    fused, refs = _members(2)
    kw = dict(lr=[0.1, 0.2], momentum=[0.9, 0.0], weight_decay=[0.01, 0.1], dampening=[0.2, 0.0])
    fopt = fusion.optim.SGD(fused.parameters(), maximize=maximize, **kw)
    ropts = [torch.optim.SGD(r.parameters(), maximize=maximize, **{k: v[i] for k, v in kw.items()})
             for i, r in enumerate(refs)]
    _train_side_by_side(fused, fopt, refs, ropts, 2)
    torch.manual_seed(5)
    newcomer = mlp().to(D)
    refs.append(copy.deepcopy(newcomer))
    fused.add_members([newcomer])
    fopt.add_members(1, lr=0.05, momentum=0.5, weight_decay=0.05, dampening=0.1)
    ropts.append(torch.optim.SGD(refs[-1].parameters(), lr=0.05, momentum=0.5, weight_decay=0.05, dampening=0.1,
                                 maximize=maximize))
    _train_side_by_side(fused, fopt, refs, ropts, 3)


def test_sgd_member_without_momentum_ignores_a_non_finite_buffer():
    """A member without momentum takes the plain gradient, whatever its (unused) buffer row holds."""
    fused, refs = _members(3)
    kw = dict(lr=[0.1, 0.2, 0.05], momentum=[0.9, 0.0, 0.5])
    fopt = fusion.optim.SGD(fused.parameters(), **kw)
    ropts = [torch.optim.SGD(r.parameters(), **{k: v[i] for k, v in kw.items()}) for i, r in enumerate(refs)]
    _train_side_by_side(fused, fopt, refs, ropts, 1)
    for p in fused.parameters():
        fopt.state[p]["momentum_buffer"][1] = float("nan")
    fused_params = dict(fused.module.named_parameters())
    for _ in range(2):
        x, y = batch(3)
        fopt.zero_grad()
        fusion.per_member_loss(F.cross_entropy, fused(x), y).sum().backward()
        fopt.step()
        for i, (r, o) in enumerate(zip(refs, ropts)):
            o.zero_grad()
            F.cross_entropy(r(x[i]), y[i]).backward()
            o.step()
        for i, r in enumerate(refs):
            for name, p in r.named_parameters():
                assert_close(fused_params[name][i].detach(), p.detach(), f"member {i} {name}", D)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_parameter_without_gradient_for_a_while(opt):
    """A parameter left without gradient keeps its state still (torch skips it), so its step
    counts trail the others' and the batched step updates it separately."""
    fused, refs = _members(3)
    if opt == "sgd":
        kw = dict(lr=[0.1, 0.2, 0.05], momentum=[0.9, 0.3, 0.5], weight_decay=[0.0, 0.01, 0.1])
        fopt = fusion.optim.SGD(fused.parameters(), **kw)
        ropts = [torch.optim.SGD(r.parameters(), **{k: v[i] for k, v in kw.items()}) for i, r in enumerate(refs)]
    else:
        kw = dict(lr=[1e-2, 3e-3, 2e-2], betas=[(0.9, 0.999), (0.5, 0.9), (0.8, 0.99)])
        fopt = fusion.optim.Adam(fused.parameters(), **kw)
        ropts = [torch.optim.Adam(r.parameters(), **{k: v[i] for k, v in kw.items()}) for i, r in enumerate(refs)]
    _train_side_by_side(fused, fopt, refs, ropts, 2, drop_grad="3.bias")
    _train_side_by_side(fused, fopt, refs, ropts, 3)
    if opt == "adam":
        steps = {name: fopt.state[p]["step"].tolist() for name, p in fused.module.named_parameters()}
        assert steps["3.bias"] == [3.0] * 3 and steps["3.weight"] == [5.0] * 3


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_edited_hyper_parameters_take_effect(opt):
    """Per-member values are cached as tensors; an edit of the group's list, in place or by
    replacing it, is used from the next step on."""
    fused, refs = _members(3)
    if opt == "sgd":
        kw = dict(lr=[0.1, 0.2, 0.05], momentum=[0.9, 0.3, 0.5])
        fopt = fusion.optim.SGD(fused.parameters(), **kw)
        ropts = [torch.optim.SGD(r.parameters(), **{k: v[i] for k, v in kw.items()}) for i, r in enumerate(refs)]
    else:
        kw = dict(lr=[1e-2, 3e-3, 2e-2], weight_decay=[0.0, 0.1, 0.2])
        fopt = fusion.optim.Adam(fused.parameters(), **kw)
        ropts = [torch.optim.Adam(r.parameters(), **{k: v[i] for k, v in kw.items()}) for i, r in enumerate(refs)]
    _train_side_by_side(fused, fopt, refs, ropts, 2)
    fopt.param_groups[0]["lr"][1] = 0.5 if opt == "sgd" else 5e-2  # in place
    ropts[1].param_groups[0]["lr"] = fopt.param_groups[0]["lr"][1]
    _train_side_by_side(fused, fopt, refs, ropts, 1)
    fopt.param_groups[0]["weight_decay"] = [0.3, 0.0, 0.01]  # replaced
    for o, wd in zip(ropts, [0.3, 0.0, 0.01]):
        o.param_groups[0]["weight_decay"] = wd
    _train_side_by_side(fused, fopt, refs, ropts, 2)
    fopt.param_groups[0]["lr"] = [fopt.param_groups[0]["lr"][0]] * 3  # now shared by all members
    for o in ropts:
        o.param_groups[0]["lr"] = fopt.param_groups[0]["lr"][0]
    _train_side_by_side(fused, fopt, refs, ropts, 2)


def _count_calls(monkeypatch, name: str) -> list[int]:
    calls = [0]
    original = getattr(torch, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, name, counted)
    return calls


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_fused_kernel_once_per_group_when_members_share_every_value(opt, monkeypatch):
    kernel = "_fused_sgd_" if opt == "sgd" else "_fused_adam_"
    calls = _count_calls(monkeypatch, kernel)
    fused, _ = _members(4)
    if opt == "sgd":
        shared = fusion.optim.SGD(fused.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        per_member = fusion.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3, 0.4], momentum=0.9)
    else:
        shared = fusion.optim.Adam(fused.parameters(), lr=1e-3)
        per_member = fusion.optim.Adam(fused.parameters(), lr=[1e-3, 2e-3, 3e-3, 4e-3])
    for optimizer, expected in ((shared, 3), (per_member, 3)):
        for _ in range(3):
            x, y = batch(4)
            optimizer.zero_grad()
            fusion.per_member_loss(F.cross_entropy, fused(x), y).sum().backward()
            optimizer.step()
        assert calls[0] == expected  # one call per step for the shared values, none per member


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_member_skipped_once_by_the_grad_scaler_resumes_like_torch(opt):
    """GradScaler restores a skipped member's state (its step counts too) behind the
    optimizer's back; the optimizer's host-side copies of the counts must notice."""
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)) for _ in range(3)]
    refs = [copy.deepcopy(m) for m in members]
    fused = fusion.fuse(members)
    lrs = [0.1, 0.05, 0.02] if opt == "sgd" else [1e-2, 5e-3, 2e-2]
    if opt == "sgd":
        fopt = fusion.optim.SGD(fused.parameters(), lr=lrs, momentum=[0.9, 0.5, 0.8])
        ropts = [torch.optim.SGD(r.parameters(), lr=lr, momentum=m) for r, lr, m in zip(refs, lrs, [0.9, 0.5, 0.8])]
    else:
        fopt = fusion.optim.Adam(fused.parameters(), lr=lrs)
        ropts = [torch.optim.Adam(r.parameters(), lr=lr) for r, lr in zip(refs, lrs)]
    # Member 1 overflows at the first step only (loss ~1e4 * 2**116 > float32's max), then
    # its scale is backed off far enough.
    scales = [2.0**10, 2.0**116, 2.0**16]
    scaler = fusion.amp.GradScaler(3, init_scale=scales, backoff_factor=2.0**-8, growth_interval=1000)
    rscalers = [torch.amp.GradScaler("cpu", init_scale=s, backoff_factor=2.0**-8, growth_interval=1000)
                for s in scales]
    for step in range(4):
        x, y = torch.randn(3, 8, 4), torch.randint(0, 3, (3, 8))
        fopt.zero_grad()
        scaler.scale(fusion.per_member_loss(F.cross_entropy, fused(x), y) * 1e4).sum().backward()
        scaler.step(fopt)
        scaler.update()
        for b, (r, o, s) in enumerate(zip(refs, ropts, rscalers)):
            o.zero_grad()
            s.scale(F.cross_entropy(r(x[b]), y[b]) * 1e4).backward()
            s.step(o)
            s.update()
            assert scaler.get_scale()[b] == s.get_scale(), f"step {step} scale of member {b}"
            sd = fused.member_state_dict(b)
            for k, v in r.state_dict().items():
                assert_close(sd[k], v, f"step {step} member {b} {k}", torch.float32)
    assert rscalers[1].get_scale() < scales[1]  # member 1 did skip a step
