"""The fused Linear's own backward: gradients in the weight's layout, and every autograd
feature of the plain path (double backward, forward-mode AD, torch.func transforms)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad
from torch.func import functional_call, grad, jvp, vmap

import fusetune.fusion as fusion
import fusetune.fusion.nn._linear as linear
from fusetune.fusion.nn._linear import _BatchedLinear

D = torch.float64
B = 3


@pytest.fixture(autouse=True)
def _custom_backward_for_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the custom backward: use it for their small weights too."""
    monkeypatch.setattr(linear, "CUSTOM_BACKWARD_MIN_NUMEL", 0)


def members() -> tuple[fusion.FusedModel, list[nn.Module]]:
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2, bias=False)).to(D) for _ in range(B)]
    refs = [copy.deepcopy(m) for m in models]
    return fusion.fuse(models), refs


def test_weight_gradient_has_the_weight_layout():
    fused, _ = members()
    x = torch.randn(B, 6, 4, dtype=D)
    fused(x).pow(2).sum().backward()
    for p in fused.parameters():
        assert p.grad is not None and p.grad.stride() == p.stride()


def test_gradcheck_and_gradgradcheck():
    args = (torch.randn(2, 3, 4, dtype=D, requires_grad=True), torch.randn(2, 5, 4, dtype=D, requires_grad=True))
    for bias in (torch.randn(2, 5, dtype=D, requires_grad=True), None):
        assert torch.autograd.gradcheck(_BatchedLinear.apply, (*args, bias), check_forward_ad=True)
        assert torch.autograd.gradgradcheck(_BatchedLinear.apply, (*args, bias))


def test_double_backward_matches_separate_models():
    fused, refs = members()
    x = torch.randn(B, 6, 4, dtype=D, requires_grad=True)
    params = list(fused.parameters())
    grads = torch.autograd.grad(fused(x).pow(2).sum(), params + [x], create_graph=True)
    second = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), params)
    for b, r in enumerate(refs):
        xb = x[b].detach().requires_grad_()
        ref_grads = torch.autograd.grad(r(xb).pow(2).sum(), list(r.parameters()) + [xb], create_graph=True)
        ref_second = torch.autograd.grad(sum(g.pow(2).sum() for g in ref_grads), list(r.parameters()))
        for got, expected in zip(second, ref_second):
            torch.testing.assert_close(got[b], expected)


def test_forward_mode_ad_matches_separate_models():
    fused, refs = members()
    x, t = torch.randn(B, 6, 4, dtype=D), torch.randn(B, 6, 4, dtype=D)
    with forward_ad.dual_level():
        out = fused(forward_ad.make_dual(x, t))
        tangent = forward_ad.unpack_dual(out).tangent
        for b, r in enumerate(refs):
            ref = forward_ad.unpack_dual(r(forward_ad.make_dual(x[b], t[b]))).tangent
            torch.testing.assert_close(tangent[b], ref)


def test_torch_func_transforms():
    fused, refs = members()
    x = torch.randn(B, 6, 4, dtype=D)
    fused(x)  # the fused model's dry run, outside the transforms
    params = dict(fused.named_parameters())
    grads = grad(lambda p: functional_call(fused, p, (x,)).pow(2).sum())(params)
    expected = torch.autograd.grad(fused(x).pow(2).sum(), list(params.values()))
    for got, e in zip(grads.values(), expected):
        torch.testing.assert_close(got, e)
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    _, out_t = jvp(lambda p: functional_call(fused, p, (x,)), (params,), (tangents,))
    with forward_ad.dual_level():
        dual = {k: forward_ad.make_dual(v.detach(), tangents[k]) for k, v in params.items()}
        expected_t = forward_ad.unpack_dual(functional_call(fused, dual, (x,))).tangent
    torch.testing.assert_close(out_t, expected_t)
    xs = torch.randn(2, B, 6, 4, dtype=D)
    with torch.no_grad():
        stacked = vmap(lambda xi: fused(xi))(xs)
        torch.testing.assert_close(stacked, torch.stack([fused(xi) for xi in xs]))
