"""Equivalence of the issue-2 layers and optimizers: fused array vs B separate copies."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _fusion_helpers import classification_batch, make_members, run_equivalence
from torch import nn

import fusetune.fusion as fusion

B = 3
LRS = [0.1, 0.05, 0.02]


def digits_mlp(hidden: int = 16, p: float = 0.0, act: type[nn.Module] = nn.ReLU) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(64, hidden), act(), nn.Dropout(p), nn.Linear(hidden, hidden), act(),
        nn.Linear(hidden, 10),
    )


def digits_cnn(c: int = 4, bias: bool = True) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1, bias=bias), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1, bias=bias), nn.BatchNorm2d(2 * c), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * c, 10),
    )


class FunctionalNet(nn.Module):
    """Forward full of ops the engine must leave alone: residual add, view,
    torch.flatten, F.relu, torch.cat(dim=1), indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.bn = nn.BatchNorm1d(12)
        self.fc1 = nn.Linear(3 * 8 * 8, 12)
        self.fc2 = nn.Linear(12, 12)
        self.head = nn.Linear(24 + 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(x)) + x  # residual add with broadcast over channels
        flat = torch.flatten(h, 1)
        a = torch.tanh(self.bn(self.fc1(flat)))
        b = self.fc2(a) + a
        v = h.view(h.size(0), -1)[:, :4]
        return self.head(torch.cat([a, F.gelu(b), v], dim=1))


def cnn_for(opt: str):
    """Adam runs use convs without bias: a conv bias feeding BatchNorm has an
    exactly zero true gradient, so its computed gradient is rounding noise
    (~1e-17) that Adam divides by its own square root -- the update is a ratio
    of rounding errors and not comparable between any two implementations
    (it then leaks into the next BatchNorm's running mean). SGD runs keep the
    bias, where noise stays noise-sized."""
    return digits_cnn if opt == "sgd" else (lambda: digits_cnn(bias=False))


def mlp_batch(dtype: torch.dtype, shared: bool = False):
    return lambda b: classification_batch(b, 5, (8, 8), 10, dtype, shared)


def img_batch(dtype: torch.dtype, shared: bool = False):
    return lambda b: classification_batch(b, 6, (1, 8, 8), 10, dtype, shared)


SGD_KW = dict(lr=LRS, momentum=[0.9, 0.0, 0.5], weight_decay=[0.0, 1e-2, 5e-3], dampening=[0.0, 0.1, 0.0])


def sgd_pair():
    def ref(i, m):
        return torch.optim.SGD(m.parameters(), **{k: v[i] for k, v in SGD_KW.items()})

    def fused(f):
        return fusion.optim.SGD(f.parameters(), **SGD_KW)

    return ref, fused


ADAM_KW = dict(lr=[1e-2, 3e-3, 5e-2], betas=[(0.9, 0.999), (0.8, 0.99), (0.5, 0.9)],
               eps=[1e-8, 1e-6, 1e-7], weight_decay=[0.0, 1e-2, 0.1])


def adam_pair(amsgrad: bool = False):
    def ref(i, m):
        return torch.optim.Adam(m.parameters(), amsgrad=amsgrad, **{k: v[i] for k, v in ADAM_KW.items()})

    def fused(f):
        return fusion.optim.Adam(f.parameters(), amsgrad=amsgrad, **ADAM_KW)

    return ref, fused


@pytest.mark.parametrize("act", [nn.ReLU, nn.GELU, nn.Tanh])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_mlp_float64(act, opt):
    ref, fused = sgd_pair() if opt == "sgd" else adam_pair()
    run_equivalence(lambda: digits_mlp(act=act), mlp_batch(torch.float64), ref, fused, b=B)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_cnn_batchnorm_float64(opt):
    ref, fused = sgd_pair() if opt == "sgd" else adam_pair(amsgrad=True)
    run_equivalence(cnn_for(opt), img_batch(torch.float64), ref, fused, b=B)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_cnn_float32_shared_input(opt):
    ref, fused = sgd_pair() if opt == "sgd" else adam_pair()
    run_equivalence(cnn_for(opt), img_batch(torch.float32, shared=True), ref, fused, b=B, dtype=torch.float32)


def test_mlp_float32():
    ref, fused = adam_pair()
    run_equivalence(digits_mlp, mlp_batch(torch.float32), ref, fused, b=B, dtype=torch.float32)


def test_functional_forward_unchanged():
    ref, fused = sgd_pair()
    run_equivalence(FunctionalNet, img_batch(torch.float64), ref, fused, b=B, steps=4)


def test_single_member():
    def ref(i, m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True)

    def fused(f):
        return fusion.optim.SGD(f.parameters(), lr=0.1, momentum=0.9, nesterov=True)

    run_equivalence(digits_cnn, img_batch(torch.float64), ref, fused, b=1)


def test_sgd_nesterov_maximize():
    kw = dict(lr=LRS, momentum=[0.9, 0.5, 0.1], nesterov=True, maximize=True, weight_decay=[0.0, 0.1, 0.01])

    def ref(i, m):
        return torch.optim.SGD(m.parameters(), **{k: (v[i] if isinstance(v, list) else v) for k, v in kw.items()})

    def fused(f):
        return fusion.optim.SGD(f.parameters(), **kw)

    run_equivalence(digits_mlp, mlp_batch(torch.float64), ref, fused, b=B)


def test_batchnorm1d_momentum_none_and_per_member_momentum():
    def factory():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 10))

    members = make_members(factory, B, torch.float64)
    # A per-member BatchNorm momentum is a legitimate per-trial setting.
    members[1][2].momentum = 0.3
    refs = [copy.deepcopy(m) for m in members]
    fused = fusion.fuse(members)
    for _ in range(3):
        x = torch.randn(B, 7, 8, 8, dtype=torch.float64)
        out = fused(x)
        for i, r in enumerate(refs):
            torch.testing.assert_close(out[i], r(x[i]), rtol=1e-10, atol=1e-12)
    for i, r in enumerate(refs):
        for k, v in r.state_dict().items():
            torch.testing.assert_close(fused.member_state_dict(i)[k], v, rtol=1e-10, atol=1e-12)


def test_dropout_per_member_p():
    torch.manual_seed(0)
    members = [digits_mlp(p=p) for p in (0.0, 0.5, 1.0)]
    fused = fusion.fuse(members)
    drop = fused.module[3]
    assert drop.p == [0.0, 0.5, 1.0]
    x = torch.ones(3, 2000, 16, dtype=torch.float32)
    y = drop(x.reshape(-1, 16)).reshape(3, 2000, 16)
    assert torch.equal(y[0], x[0])  # p=0: identity
    assert not y[2].any()  # p=1: all dropped, no NaN
    kept = y[1] != 0
    assert torch.all(y[1][kept] == 2.0)  # scaled by 1/(1-p)
    assert 0.45 < kept.float().mean().item() < 0.55
    fused.eval()
    assert torch.equal(drop(x.reshape(-1, 16)), x.reshape(-1, 16))


@pytest.mark.parametrize("kind", [nn.Dropout1d, nn.Dropout2d, nn.Dropout3d])
def test_feature_dropout_per_member_p_masks_whole_channels(kind):
    torch.manual_seed(0)
    spatial = {nn.Dropout1d: (9,), nn.Dropout2d: (3, 3), nn.Dropout3d: (1, 3, 3)}[kind]
    members = [nn.Sequential(nn.Identity(), kind(p)) for p in (0.25, 0.75)]
    fused = fusion.fuse(members)
    drop = fused.module[1]
    x = torch.ones(2 * 500, 4, *spatial)
    y = drop(x).reshape(2, 500, 4, 9)
    assert torch.all((y == 0).all(-1) | (y != 0).all(-1))
    rates = (y[..., 0] == 0).float().mean(dim=(1, 2))
    assert abs(rates[0].item() - 0.25) < 0.05 and abs(rates[1].item() - 0.75) < 0.05


def test_member_state_dict_loads_into_original_class():
    members = make_members(digits_cnn, B, torch.float32)
    fused = fusion.fuse(members)
    opt = fusion.optim.Adam(fused.parameters(), lr=LRS)
    x, y = classification_batch(B, 6, (1, 8, 8), 10, torch.float32)
    for _ in range(2):
        opt.zero_grad()
        fusion.per_member_loss(nn.CrossEntropyLoss(), fused(x), y).sum().backward()
        opt.step()
    fused.eval()
    with torch.no_grad():
        out = fused(x)
    for b in range(B):
        model = digits_cnn()
        model.load_state_dict(fused.member_state_dict(b), strict=True)
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x[b]), out[b], rtol=1e-5, atol=1e-6)
        member = fused.member(b)
        assert type(member) is nn.Sequential and not member.training
        with torch.no_grad():
            torch.testing.assert_close(member(x[b]), out[b], rtol=1e-5, atol=1e-6)


def test_per_member_loss_matches_loss_fn():
    torch.manual_seed(0)
    out = torch.randn(4, 7, 5, dtype=torch.float64)
    y = torch.randint(0, 5, (4, 7))
    y[1, :3] = -100
    for fn in (F.cross_entropy, nn.CrossEntropyLoss(), nn.CrossEntropyLoss(label_smoothing=0.1),
               nn.CrossEntropyLoss(weight=torch.rand(5, dtype=torch.float64))):
        losses = fusion.per_member_loss(fn, out, y)
        assert losses.shape == (4,)
        for b in range(4):
            torch.testing.assert_close(losses[b], fn(out[b], y[b]), rtol=1e-12, atol=1e-14)
    target = torch.randn(4, 7, 5, dtype=torch.float64)
    for fn in (F.mse_loss, nn.L1Loss(), nn.SmoothL1Loss()):
        losses = fusion.per_member_loss(fn, out, target)
        for b in range(4):
            torch.testing.assert_close(losses[b], fn(out[b], target[b]), rtol=1e-12, atol=1e-14)
    smoothing = [nn.CrossEntropyLoss(label_smoothing=s) for s in (0.0, 0.1, 0.2, 0.3)]
    losses = fusion.per_member_loss(smoothing, out, y)
    for b in range(4):
        torch.testing.assert_close(losses[b], smoothing[b](out[b], y[b]))


def test_broadcast_shape_and_view():
    x = torch.randn(5, 3)
    xb = fusion.broadcast(x, 4)
    assert xb.shape == (4, 5, 3)
    assert xb.data_ptr() == x.data_ptr()


def test_train_eval_flags_propagate():
    fused = fusion.fuse(make_members(digits_cnn, 2, torch.float32))
    fused.eval()
    assert all(not m.training for m in fused.modules())
    fused.train()
    assert all(m.training for m in fused.modules())
    assert fused.num_members == 2


def test_bf16_autocast_on_cpu():
    """Under torch.autocast(cpu, bf16) the fused array matches B separately
    autocast models (bf16 tolerance) in outputs and float32 gradients."""
    torch.manual_seed(0)
    members = [digits_cnn() for _ in range(B)]
    refs = [copy.deepcopy(m) for m in members]
    fused = fusion.fuse(members)
    x, y = classification_batch(B, 8, (1, 8, 8), 10, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused(x)
        losses = fusion.per_member_loss(F.cross_entropy, out, y)
    losses.sum().backward()
    params = dict(fused.module.named_parameters())
    for b, r in enumerate(refs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_out = r(x[b])
            F.cross_entropy(ref_out, y[b]).backward()
        assert out.dtype == ref_out.dtype == torch.bfloat16
        torch.testing.assert_close(out[b].float(), ref_out.float(), rtol=2e-2, atol=2e-2)
        for name, p in r.named_parameters():
            assert params[name].grad.dtype == torch.float32
            torch.testing.assert_close(params[name].grad[b], p.grad, rtol=5e-2, atol=5e-2 * float(p.grad.abs().max()))


def test_per_member_loss_sequence_targets():
    """[B, N, C, T] logits with [B, N, T] targets (language models), with ignored positions."""
    torch.manual_seed(0)
    out = torch.randn(3, 4, 6, 5, dtype=torch.float64)
    y = torch.randint(0, 6, (3, 4, 5))
    y[2, :, -2:] = -100
    for fn in (F.cross_entropy, nn.CrossEntropyLoss(label_smoothing=0.2)):
        losses = fusion.per_member_loss(fn, out, y)
        for b in range(3):
            torch.testing.assert_close(losses[b], fn(out[b], y[b]), rtol=1e-12, atol=1e-14)


def test_per_member_loss_of_a_loss_function_that_calls_cross_entropy():
    """A loss written around F.cross_entropy (a language model's reshape, CLIP's symmetric
    loss) runs under vmap with the cross-entropy folded for all members: the same values and
    gradients as each member's own loss, ignored targets and label smoothing included."""
    torch.manual_seed(0)
    out = torch.randn(3, 4, 5, 6, dtype=torch.float64, requires_grad=True)  # [B, N, T, vocab]
    y = torch.randint(0, 6, (3, 4, 5))
    y[1, :2] = -100

    def lm(logits, targets, smoothing=0.0):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), label_smoothing=smoothing)

    for fn in (lm, lambda o, t: lm(o, t, 0.1), lambda o, t: F.cross_entropy(o[:, -1], t[:, -1]) + lm(o, t)):
        losses = fusion.per_member_loss(fn, out, y)
        (grad,) = torch.autograd.grad(losses.sum(), out)
        for b in range(3):
            ref = fn(out[b], y[b])
            torch.testing.assert_close(losses[b], ref, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(grad[b], torch.autograd.grad(ref, out)[0][b], rtol=1e-12, atol=1e-14)
