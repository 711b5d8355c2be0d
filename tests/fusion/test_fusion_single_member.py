"""An array of one member trains exactly like the model alone (its layers, loss and
optimizer take their single-member paths)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _fusion_helpers import classification_batch, run_equivalence
from torch import nn

import fusetune.fusion as fusion

D = torch.float64


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.PReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.LayerNorm(12), nn.Linear(12, 5),
    )


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.ReLU(), nn.Dropout(0.0), nn.Linear(12, 5))


@pytest.mark.parametrize("model", [mlp, cnn])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_single_member_array_matches_the_model_alone(model, opt):
    if opt == "sgd":
        def ref(i, m):
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)

        def fused(f):
            return fusion.optim.SGD(f.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    else:
        def ref(i, m):
            return torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=1e-3)

        def fused(f):
            return fusion.optim.Adam(f.parameters(), lr=1e-2, weight_decay=1e-3)
    run_equivalence(model, lambda b: classification_batch(b, 6, (1, 4, 4), 5, D), ref, fused, b=1, steps=3)


def test_single_member_loss_is_the_loss_itself():
    out = torch.randn(1, 7, 5, dtype=D, requires_grad=True)
    y = torch.randint(0, 5, (1, 7))
    for fn in (F.cross_entropy, nn.CrossEntropyLoss(label_smoothing=0.1), F.mse_loss):
        target = y if fn is not F.mse_loss else torch.randn(1, 7, 5, dtype=D)
        losses = fusion.per_member_loss(fn, out, target)
        assert losses.shape == (1,)
        assert torch.equal(losses[0], fn(out[0], target[0]))
