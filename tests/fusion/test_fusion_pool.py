"""The MaxPool2d twin (channels-last kernel on the CPU) gives exactly nn.MaxPool2d's results."""

from __future__ import annotations

import pytest
import torch
from _fusion_helpers import classification_batch, run_equivalence
from torch import nn

import fusetune.fusion as fusion
from fusetune.fusion.nn._pool import CHANNELS_LAST_MIN_CHANNELS, MaxPool2d

D = torch.float64


@pytest.mark.parametrize("config", [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=2, dilation=2),
    dict(kernel_size=(3, 2), stride=1, padding=(1, 0)),
])
@pytest.mark.parametrize("channels", [CHANNELS_LAST_MIN_CHANNELS, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_same_values_indices_and_gradients(config, channels, dtype):
    torch.manual_seed(0)
    ref = nn.MaxPool2d(**config, return_indices=True)
    twin = MaxPool2d(2, ref)
    x = torch.relu(torch.randn(6, channels, 9, 9, dtype=dtype)).round()  # ties everywhere
    x[0, 0, 0, 0], x[1, 2, 3, 3], x[2, 1] = float("nan"), float("inf"), 0.0
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_r, idx_r = ref(xr)
    out_t, idx_t = twin(xt)
    assert out_t.is_contiguous() and idx_t.is_contiguous()
    assert torch.equal(idx_t, idx_r)
    assert torch.equal(out_t.isnan(), out_r.isnan()) and torch.equal(out_t.nan_to_num(), out_r.nan_to_num())
    g = torch.randn_like(out_r)
    out_r.backward(g)
    out_t.backward(g)
    assert torch.equal(xt.grad, xr.grad)
    with torch.no_grad():
        assert torch.equal(twin(x)[0].nan_to_num(), ref(x)[0].nan_to_num())


def test_double_backward():
    twin = MaxPool2d(1, nn.MaxPool2d(2))
    x = torch.randn(2, CHANNELS_LAST_MIN_CHANNELS, 4, 4, dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(twin, (x,))
    assert torch.autograd.gradgradcheck(twin, (x,))


def cnn() -> nn.Module:
    c = CHANNELS_LAST_MIN_CHANNELS
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c * 16, 5),
    )


def test_fused_array_with_pooling_matches_separate_models():
    def ref(i, m):
        return torch.optim.SGD(m.parameters(), lr=[0.1, 0.05, 0.2][i], momentum=0.9)

    def fused(f):
        return fusion.optim.SGD(f.parameters(), lr=[0.1, 0.05, 0.2], momentum=0.9)

    model = run_equivalence(cnn, lambda b: classification_batch(b, 6, (1, 8, 8), 5, D), ref, fused, b=3)
    assert isinstance(model.module[3], MaxPool2d)
    assert type(model.member(0)[3]) is nn.MaxPool2d
    model.remove_members([1])
    assert model.module[3].num_members == 2
    x, _ = classification_batch(2, 6, (1, 8, 8), 5, D)
    out = model(x)
    for b in range(2):
        torch.testing.assert_close(out[b], model.member(b)(x[b]))
