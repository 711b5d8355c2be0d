"""Per-member gradient scaling: one member's overflow skips only its own step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _fusion_helpers import assert_close
from torch import nn

import fusetune.fusion as fusion

B = 3
SCALES = [2.0**10, 2.0**120, 2.0**16]  # member 1 overflows (grads ~1e4 * 2**120 > float32 max)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_grad_scaler_matches_separate_scalers(opt):
    torch.manual_seed(0)
    members = [mlp() for _ in range(B)]
    refs = [copy.deepcopy(m) for m in members]
    fused = fusion.fuse(members)
    lrs = [0.1, 0.05, 0.02]
    if opt == "sgd":
        fopt = fusion.optim.SGD(fused.parameters(), lr=lrs, momentum=0.9)
        ropts = [torch.optim.SGD(r.parameters(), lr=lr, momentum=0.9) for r, lr in zip(refs, lrs)]
    else:
        fopt = fusion.optim.Adam(fused.parameters(), lr=lrs)
        ropts = [torch.optim.Adam(r.parameters(), lr=lr) for r, lr in zip(refs, lrs)]
    scaler = fusion.amp.GradScaler(B, init_scale=SCALES, growth_interval=2)
    rscalers = [torch.amp.GradScaler("cpu", init_scale=s, growth_interval=2) for s in SCALES]
    for step in range(5):
        x = torch.randn(B, 8, 4)
        y = torch.randint(0, 3, (B, 8))
        fopt.zero_grad()
        losses = fusion.per_member_loss(F.cross_entropy, fused(x), y) * 1e4
        scaler.scale(losses).sum().backward()
        scaler.unscale_(fopt)
        fusion.clip_grad_norm_(fused.parameters(), 1e6)
        scaler.step(fopt)
        scaler.update()
        for b, (r, o, s) in enumerate(zip(refs, ropts, rscalers)):
            o.zero_grad()
            s.scale(F.cross_entropy(r(x[b]), y[b]) * 1e4).backward()
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(r.parameters(), 1e6)
            s.step(o)
            s.update()
            assert scaler.get_scale()[b] == s.get_scale(), f"step {step} scale of member {b}"
            sd = fused.member_state_dict(b)
            for k, v in r.state_dict().items():
                assert_close(sd[k], v, f"step {step} member {b} {k}", torch.float32)
    # Member 1 never stepped; the others did.
    assert torch.equal(fused.member_state_dict(1)["0.weight"], members[1][0].weight)
    assert not torch.equal(fused.member_state_dict(0)["0.weight"], members[0][0].weight)


def test_grad_scaler_membership_and_errors():
    scaler = fusion.amp.GradScaler(3, init_scale=[1.0, 2.0, 4.0])
    scaler.remove_members([1])
    scaler.add_members(2, init_scale=8.0)
    assert scaler.get_scale() == [1.0, 4.0, 8.0, 8.0]
    with pytest.raises(ValueError, match="init_scale"):
        fusion.amp.GradScaler(3, init_scale=[1.0, 2.0])
    with pytest.raises(fusion.FusionError):
        scaler.scale(torch.ones(3))
