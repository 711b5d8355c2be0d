"""Fused optimizers, schedulers and gradient clipping against their torch twins."""

from __future__ import annotations

import pytest
import torch
from _fusion_helpers import classification_batch, run_equivalence
from _fusion_helpers import optimizer_pair as pair
from torch import nn

import fusetune.fusion as fusion

B = 3


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.Tanh(), nn.LayerNorm(12), nn.Linear(12, 5))


def batch(b: int):
    return classification_batch(b, 6, (4, 4), 5, torch.float64)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, fusion.optim.AdamW,
              dict(lr=[1e-2, 3e-3, 2e-2], weight_decay=[0.0, 0.1, 0.5], betas=[(0.9, 0.99), (0.5, 0.9), (0.0, 0.5)]),
              dict(amsgrad=True)),
    "adam_maximize": (torch.optim.Adam, fusion.optim.Adam, dict(lr=[1e-2, 3e-3, 2e-2]), dict(maximize=True)),
    "rmsprop": (torch.optim.RMSprop, fusion.optim.RMSprop,
                dict(lr=[1e-2, 3e-3, 2e-2], alpha=[0.99, 0.9, 0.5], momentum=[0.0, 0.9, 0.5],
                     weight_decay=[0.0, 1e-2, 0.0], eps=[1e-8, 1e-6, 1e-7]), {}),
    "rmsprop_centered": (torch.optim.RMSprop, fusion.optim.RMSprop,
                         dict(lr=[1e-2, 3e-3, 2e-2], momentum=[0.3, 0.9, 0.5]), dict(centered=True)),
    "adagrad": (torch.optim.Adagrad, fusion.optim.Adagrad,
                dict(lr=[1e-1, 3e-2, 2e-2], lr_decay=[0.0, 0.1, 0.01], weight_decay=[0.0, 1e-2, 0.1],
                     initial_accumulator_value=[0.0, 0.1, 1.0]), {}),
    "adadelta": (torch.optim.Adadelta, fusion.optim.Adadelta,
                 dict(lr=[1.0, 0.5, 2.0], rho=[0.9, 0.5, 0.99], eps=[1e-6, 1e-5, 1e-4], weight_decay=[0.0, 0.1, 0.0]),
                 dict(maximize=False)),
    "sgd_dampening": (torch.optim.SGD, fusion.optim.SGD,
                      dict(lr=[0.1, 0.05, 0.2], momentum=[0.9, 0.8, 0.0], dampening=[0.5, 0.0, 0.3]), {}),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_equivalence(name):
    torch_cls, fused_cls, per_member, shared = OPTIMIZERS[name]
    ref, fused = pair(torch_cls, fused_cls, per_member, shared)
    run_equivalence(mlp, batch, ref, fused, b=B, steps=4)


def test_optimizer_float32_and_state_dict_round_trip():
    ref, fused_make = pair(torch.optim.Adam, fusion.optim.Adam, dict(lr=[1e-2, 3e-3, 2e-2]))
    fused = run_equivalence(mlp, lambda b: classification_batch(b, 6, (4, 4), 5, torch.float32), ref,
                            lambda f: fused_make(f), b=B, dtype=torch.float32)
    opt = fusion.optim.Adam(fused.parameters(), lr=[1e-2, 3e-3, 2e-2])
    fused.train()
    x, y = classification_batch(B, 6, (4, 4), 5, torch.float32)
    fusion.per_member_loss(nn.functional.cross_entropy, fused(x), y).sum().backward()
    opt.step()
    sd = opt.state_dict()
    opt2 = fusion.optim.Adam(fused.parameters(), lr=0.5)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == [1e-2, 3e-3, 2e-2]
    for p in fused.parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(opt2.state[p][k], v)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_per_member(norm_type):
    torch.manual_seed(0)
    models = [mlp().double() for _ in range(B)]
    fused = fusion.fuse(models)
    x, y = batch(B)
    fusion.per_member_loss(nn.functional.cross_entropy, fused(x), y).sum().backward()
    limits = [1e-3, 0.05, 100.0]
    totals = fusion.clip_grad_norm_(fused.parameters(), limits, norm_type=norm_type)
    params = dict(fused.module.named_parameters())
    for b, m in enumerate(models):
        nn.functional.cross_entropy(m(x[b]), y[b]).backward()
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), limits[b], norm_type=norm_type)
        torch.testing.assert_close(totals[b], total, rtol=1e-10, atol=0)
        for name, p in m.named_parameters():
            torch.testing.assert_close(params[name].grad[b], p.grad, rtol=1e-10, atol=1e-14)


def test_clip_grad_norm_in_training_loop():
    ref, fused = pair(torch.optim.SGD, fusion.optim.SGD, dict(lr=[0.5, 0.2, 1.0]))
    run_equivalence(mlp, batch, ref, fused, b=B, clip=[0.01, 0.1, 10.0])


SCHEDULERS = {
    "step": (lambda o, i: torch.optim.lr_scheduler.StepLR(o, step_size=[1, 2, 3][i], gamma=[0.5, 0.1, 0.9][i]),
             lambda o: fusion.lr_scheduler.StepLR(o, step_size=[1, 2, 3], gamma=[0.5, 0.1, 0.9])),
    "multistep": (lambda o, i: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[[1, 3], [2], [1, 2]][i], gamma=0.5),
                  lambda o: fusion.lr_scheduler.MultiStepLR(o, milestones=[[1, 3], [2], [1, 2]], gamma=0.5)),
    "exponential": (lambda o, i: torch.optim.lr_scheduler.ExponentialLR(o, gamma=[0.9, 0.5, 0.99][i]),
                    lambda o: fusion.lr_scheduler.ExponentialLR(o, gamma=[0.9, 0.5, 0.99])),
    "cosine": (lambda o, i: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=[3, 5, 2][i], eta_min=1e-4),
               lambda o: fusion.lr_scheduler.CosineAnnealingLR(o, T_max=[3, 5, 2], eta_min=1e-4)),
    "linear_warmup": (lambda o, i: torch.optim.lr_scheduler.LinearLR(o, start_factor=[0.1, 0.5, 0.25][i], total_iters=3),
                      lambda o: fusion.lr_scheduler.LinearLR(o, start_factor=[0.1, 0.5, 0.25], total_iters=3)),
    "onecycle": (lambda o, i: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[0.1, 0.3, 0.05][i], total_steps=6),
                 lambda o: fusion.lr_scheduler.OneCycleLR(o, max_lr=[0.1, 0.3, 0.05], total_steps=6)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_scheduler_equivalence(name, opt):
    make_ref_sched, make_fused_sched = SCHEDULERS[name]
    if opt == "sgd":
        ref, fused = pair(torch.optim.SGD, fusion.optim.SGD, dict(lr=[0.1, 0.05, 0.2], momentum=[0.9, 0.8, 0.5]))
    else:
        ref, fused = pair(torch.optim.Adam, fusion.optim.Adam, dict(lr=[1e-2, 3e-3, 2e-2]))
    run_equivalence(mlp, batch, ref, fused, b=B, steps=5,
                    make_ref_sched=lambda i, o: make_ref_sched(o, i), make_fused_sched=make_fused_sched)


def test_sequential_lr_warmup_then_cosine():
    def ref_sched(i, o):
        warm = torch.optim.lr_scheduler.LinearLR(o, start_factor=[0.1, 0.2, 0.5][i], total_iters=2)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=[3, 4, 5][i])
        return torch.optim.lr_scheduler.SequentialLR(o, [warm, cos], milestones=[[2], [1], [3]][i])

    def fused_sched(o):
        warm = fusion.lr_scheduler.LinearLR(o, start_factor=[0.1, 0.2, 0.5], total_iters=2)
        cos = fusion.lr_scheduler.CosineAnnealingLR(o, T_max=[3, 4, 5])
        return fusion.lr_scheduler.SequentialLR(o, [warm, cos], milestones=[[2], [1], [3]])

    ref, fused = pair(torch.optim.SGD, fusion.optim.SGD, dict(lr=[0.1, 0.05, 0.2]))
    run_equivalence(mlp, batch, ref, fused, b=B, steps=6, make_ref_sched=ref_sched, make_fused_sched=fused_sched)


def test_reduce_on_plateau_per_member_metrics():
    def ref_sched(i, o):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(o, mode="max", factor=[0.5, 0.1, 0.2][i], patience=[0, 1, 0][i])

    def fused_sched(o):
        return fusion.lr_scheduler.ReduceLROnPlateau(o, mode="max", factor=[0.5, 0.1, 0.2], patience=[0, 1, 0])

    ref, fused = pair(torch.optim.Adam, fusion.optim.Adam, dict(lr=[1e-2, 3e-3, 2e-2]))
    # mode="max" on a decreasing loss: every member eventually reduces, at its own pace.
    run_equivalence(mlp, batch, ref, fused, b=B, steps=5, make_ref_sched=ref_sched,
                    make_fused_sched=fused_sched, sched_metric=True)


def test_scheduler_state_dict_and_last_lr():
    fused = fusion.fuse([mlp() for _ in range(2)])
    opt = fusion.optim.SGD(fused.parameters(), lr=[0.1, 0.2])
    sched = fusion.lr_scheduler.StepLR(opt, step_size=1, gamma=[0.5, 0.1])
    opt.step()
    sched.step()
    assert sched.get_last_lr() == [[0.05, pytest.approx(0.02)]]
    assert sched.last_epoch == [1, 1]
    state = sched.state_dict()
    opt2 = fusion.optim.SGD(fused.parameters(), lr=[0.1, 0.2])
    sched2 = fusion.lr_scheduler.StepLR(opt2, step_size=1, gamma=[0.5, 0.1])
    sched2.load_state_dict(state)
    assert sched2.last_epoch == [1, 1]


@pytest.mark.parametrize("name", ["adamw", "adam_maximize", "sgd_dampening"])
def test_tensor_math_fallback_path(name, monkeypatch):
    """The path used where torch's fused kernels do not apply (other devices/dtypes)."""
    monkeypatch.setattr(fusion.optim.FusedOptimizer, "use_fused_kernels", False)
    torch_cls, fused_cls, per_member, shared = OPTIMIZERS[name]
    ref, fused = pair(torch_cls, fused_cls, per_member, shared)
    run_equivalence(mlp, batch, ref, fused, b=B, steps=4)


def test_sgd_nesterov_both_paths(monkeypatch):
    kw = dict(lr=[0.1, 0.05, 0.2], momentum=[0.9, 0.5, 0.1], weight_decay=[0.0, 0.1, 0.01])
    for use in (True, False):
        monkeypatch.setattr(fusion.optim.FusedOptimizer, "use_fused_kernels", use)
        ref, fused = pair(torch.optim.SGD, fusion.optim.SGD, kw, dict(nesterov=True))
        run_equivalence(mlp, batch, ref, fused, b=B)
