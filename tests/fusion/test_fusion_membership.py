"""Export/import and membership changes (remove finished members, add new ones)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _fusion_helpers import assert_close, compare_optimizer_state, compare_state
from torch import nn

import fusetune.fusion as fusion

D = torch.float64


def cnn() -> nn.Module:
    # No conv bias before BatchNorm: its true gradient is zero, and Adam would
    # turn the rounding noise into incomparable updates (see run_equivalence).
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU(), nn.Dropout(0.0),
        nn.Flatten(), nn.Linear(3 * 16, 5),
    )


def step_all(fused, fopt, refs, ref_opts, fsched=None, ref_scheds=None):
    b = fused.num_members
    x = torch.randn(b, 4, 1, 4, 4, dtype=D)
    y = torch.randint(0, 5, (b, 4))
    fopt.zero_grad()
    out = fused(x)
    fusion.per_member_loss(F.cross_entropy, out, y).sum().backward()
    fopt.step()
    for i, (r, o) in enumerate(zip(refs, ref_opts)):
        o.zero_grad()
        ref_out = r(x[i])
        assert_close(out[i].detach(), ref_out.detach(), f"output {i}", D)
        F.cross_entropy(ref_out, y[i]).backward()
        o.step()
    if fsched is not None:
        fsched.step()
        for s in ref_scheds:
            s.step()
    compare_state(fused, refs, D, "after step")
    compare_optimizer_state(fopt, ref_opts, fused, refs, D, "after step")


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_remove_and_add_members(opt):
    torch.manual_seed(0)
    models = [cnn().double() for _ in range(3)]
    refs = [copy.deepcopy(m) for m in models]
    fused = fusion.fuse(models)
    if opt == "sgd":
        kw = dict(lr=[0.1, 0.2, 0.05], momentum=[0.9, 0.5, 0.8], dampening=[0.1, 0.0, 0.2])
        fopt = fusion.optim.SGD(fused.parameters(), **kw)
        ref_opts = [torch.optim.SGD(r.parameters(), **{k: v[i] for k, v in kw.items()}) for i, r in enumerate(refs)]
    else:
        kw = dict(lr=[1e-2, 2e-2, 5e-3], betas=[(0.9, 0.99), (0.5, 0.9), (0.8, 0.999)])
        fopt = fusion.optim.Adam(fused.parameters(), **kw)
        ref_opts = [torch.optim.Adam(r.parameters(), **{k: v[i] for k, v in kw.items()}) for i, r in enumerate(refs)]
    fsched = fusion.lr_scheduler.StepLR(fopt, step_size=1, gamma=[0.5, 0.9, 0.7])
    ref_scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=g) for o, g in zip(ref_opts, [0.5, 0.9, 0.7])]
    for _ in range(2):
        step_all(fused, fopt, refs, ref_opts, fsched, ref_scheds)

    # Member 1 finished: drop it everywhere.
    params_before = [id(p) for p in fused.parameters()]
    fused.remove_members([1])
    fopt.remove_members([1])
    assert [id(p) for p in fused.parameters()] == params_before
    assert fused.num_members == 2 and fopt.param_groups[0]["lr"] == [ref_opts[0].param_groups[0]["lr"],
                                                                      ref_opts[2].param_groups[0]["lr"]]
    del refs[1], ref_opts[1], ref_scheds[1]
    step_all(fused, fopt, refs, ref_opts, fsched, ref_scheds)

    # A new trial joins at epoch 0 while the others are at epoch 3.
    torch.manual_seed(1)
    newcomer = cnn().double()
    newcomer[1].momentum = 0.5  # its own BatchNorm momentum
    refs.append(copy.deepcopy(newcomer))
    fused.add_members([newcomer])
    if opt == "sgd":
        fopt.add_members(1, lr=0.3, momentum=0.7, dampening=0.3)
        ref_opts.append(torch.optim.SGD(refs[-1].parameters(), lr=0.3, momentum=0.7, dampening=0.3))
    else:
        fopt.add_members(1, lr=3e-2, betas=(0.7, 0.95))
        ref_opts.append(torch.optim.Adam(refs[-1].parameters(), lr=3e-2, betas=(0.7, 0.95)))
    fsched.add_members(step_size=2, gamma=0.1)
    ref_scheds.append(torch.optim.lr_scheduler.StepLR(ref_opts[-1], step_size=2, gamma=0.1))
    assert fused.num_members == 3
    for _ in range(3):
        step_all(fused, fopt, refs, ref_opts, fsched, ref_scheds)
    assert fsched.last_epoch == [6, 6, 3]


def test_remove_members_errors():
    fused = fusion.fuse([cnn() for _ in range(2)])
    with pytest.raises(fusion.FusionError):
        fused.remove_members([0, 1])
    with pytest.raises(IndexError):
        fused.remove_members([5])
    with pytest.raises(fusion.FusionError, match="shape"):
        fused.add_members([nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                         nn.Dropout(0.0), nn.Flatten(), nn.Linear(4 * 16, 5))])


def test_added_members_must_match_configuration():
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU(0.1), nn.Dropout(0.1)) for _ in range(2)])
    with pytest.raises(fusion.FusionError, match=r"'1' \(LeakyReLU\).*negative_slope"):
        fused.add_members([nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU(0.2), nn.Dropout(0.1))])
    fused.add_members([nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU(0.1), nn.Dropout(0.5))])  # p is per member
    assert fused.module[2].p == [0.1, 0.1, 0.5]


def test_export_and_resume_from_state_dicts():
    torch.manual_seed(0)
    fused = fusion.fuse([cnn() for _ in range(3)])
    opt = fusion.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3], momentum=0.9)
    x = torch.randn(3, 4, 1, 4, 4)
    y = torch.randint(0, 5, (3, 4))
    for _ in range(2):
        opt.zero_grad()
        fusion.per_member_loss(F.cross_entropy, fused(x), y).sum().backward()
        opt.step()
    saved = [fused.member_state_dict(b) for b in range(3)]
    resumed = fusion.fuse_from_state_dicts(cnn, saved)
    resumed_from_instance = fusion.fuse_from_state_dicts(cnn(), saved[::-1])
    fused.eval()
    resumed.eval()
    resumed_from_instance.eval()
    with torch.no_grad():
        torch.testing.assert_close(resumed(x), fused(x), rtol=0, atol=0)
        torch.testing.assert_close(resumed_from_instance(x.flip(0)), fused(x).flip(0), rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        bad = dict(saved[0])
        bad.pop("1.running_mean")
        fusion.fuse_from_state_dicts(cnn, [bad])


def test_fuse_seeded_members_match_seeded_construction():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    fused = fusion.fuse_seeded(cnn, [7, 8, 7])
    assert torch.equal(torch.rand(1), before)  # caller's RNG stream untouched
    for b, seed in enumerate([7, 8, 7]):
        torch.manual_seed(seed)
        ref = cnn().state_dict()
        got = fused.member_state_dict(b)
        assert all(torch.equal(got[k], v) for k, v in ref.items())
    assert not torch.equal(fused.member_state_dict(0)["0.weight"], fused.member_state_dict(1)["0.weight"])


OPTIMIZERS = {
    "sgd": lambda ps, b: fusion.optim.SGD(ps, lr=[0.1, 0.05, 0.02][:b], momentum=[0.9, 0.5, 0.0][:b], dampening=0.1),
    "sgd-nesterov": lambda ps, b: fusion.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps, b: fusion.optim.Adam(ps, lr=[1e-2, 3e-3, 2e-2][:b], amsgrad=True),
    "adamw": lambda ps, b: fusion.optim.AdamW(ps, lr=1e-2, weight_decay=[0.0, 0.01, 0.1][:b]),
    "rmsprop": lambda ps, b: fusion.optim.RMSprop(ps, lr=1e-2, momentum=[0.0, 0.9, 0.5][:b], centered=True),
    "adagrad": lambda ps, b: fusion.optim.Adagrad(ps, lr=1e-2, initial_accumulator_value=[0.0, 0.1, 0.2][:b]),
    "adadelta": lambda ps, b: fusion.optim.Adadelta(ps, lr=[1.0, 0.5, 0.1][:b]),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_member_continues_in_another_array_from_its_exported_state(name):
    """Checkpoint member 1 (weights + optimizer state), resume it as member 0 of a new array
    beside a fresh member: it trains on exactly as it would have in the old array."""
    make_opt = OPTIMIZERS[name]
    torch.manual_seed(0)
    old = fusion.fuse([cnn().to(D) for _ in range(3)])
    old_opt = make_opt(old.parameters(), 3)

    def step(fused, opt, x, y):
        opt.zero_grad()
        fusion.per_member_loss(F.cross_entropy, fused(x), y).sum().backward()
        opt.step()

    batches = [(torch.randn(3, 4, 1, 4, 4, dtype=D), torch.randint(0, 5, (3, 4))) for _ in range(6)]
    for x, y in batches[:3]:
        step(old, old_opt, x, y)
    weights, opt_state = old.member_state_dict(1), old_opt.member_state_dict(1)

    new = fusion.fuse_from_state_dicts(lambda: cnn().to(D), [weights, cnn().to(D).state_dict()])
    new_opt = make_opt(new.parameters(), 2)  # member 0's hyper-parameters come from the checkpoint
    new_opt.load_member_state_dict(0, opt_state)
    for x, y in batches[3:]:
        step(old, old_opt, x, y)
        step(new, new_opt, torch.stack([x[1], torch.randn_like(x[1])]), torch.stack([y[1], y[0]]))
    for k, v in old.member_state_dict(1).items():
        assert_close(new.member_state_dict(0)[k], v, f"{name}: {k}", D)
    resumed_state = new_opt.member_state_dict(0)
    assert resumed_state["hparams"] == old_opt.member_state_dict(1)["hparams"]
    for saved, expected in zip(resumed_state["state"], old_opt.member_state_dict(1)["state"]):
        assert saved.keys() == expected.keys()
        for k in expected:
            assert_close(saved[k], expected[k], f"{name}: optimizer state {k}", D)


def test_member_state_errors():
    fused = fusion.fuse([cnn() for _ in range(2)])
    opt = fusion.optim.Adam(fused.parameters(), lr=1e-3)
    with pytest.raises(IndexError):
        opt.member_state_dict(2)
    other = fusion.optim.Adam(list(fused.parameters())[:1], lr=1e-3)
    with pytest.raises(fusion.FusionError, match="parameters"):
        other.load_member_state_dict(0, opt.member_state_dict(0))
