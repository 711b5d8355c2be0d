"""Adjacent fused convolutions and batch norms hand each other their channel-major layout
(no copy there and back); results stay those of separate models, in-place edits included."""

from __future__ import annotations

import pytest
import torch
from _fusion_helpers import classification_batch, run_equivalence
from torch import nn

import fusetune.fusion as fusion
import fusetune.fusion.nn._base as base

D = torch.float64


class Residual(nn.Module):
    """conv -> bn, with the conv's output also added back (used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * 16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        y = self.bn(h) + h
        return self.head(torch.flatten(self.conv2(y), 1))


class InPlaceBetween(nn.Module):
    """conv -> in-place ReLU -> bn: the conv's output changes before the bn reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        h.relu_()
        return self.head(torch.flatten(self.bn(h), 1))


def chain() -> nn.Module:
    """conv -> bn -> conv -> bn: both directions of the hand-over."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6),
        nn.ReLU(), nn.Flatten(), nn.Linear(6 * 16, 5),
    )


@pytest.mark.parametrize("factory", [chain, Residual, InPlaceBetween])
def test_matches_separate_models(factory, monkeypatch):
    handed = [0]
    recall = base.recall_channel_major

    def counting(t, b):
        out = recall(t, b)
        handed[0] += out is not None
        return out

    monkeypatch.setattr("fusetune.fusion.nn._conv.recall_channel_major", counting)
    monkeypatch.setattr("fusetune.fusion.nn._norm.recall_channel_major", counting)

    def ref(i, m):
        return torch.optim.SGD(m.parameters(), lr=[0.1, 0.05, 0.2][i], momentum=0.9)

    def fused(f):
        return fusion.optim.SGD(f.parameters(), lr=[0.1, 0.05, 0.2], momentum=0.9)

    run_equivalence(factory, lambda b: classification_batch(b, 5, (1, 4, 4), 5, D), ref, fused, b=3, steps=3)
    if factory is InPlaceBetween:
        assert handed[0] == 0
    else:
        assert handed[0] > 0


def test_record_lives_as_long_as_the_tensor():
    a, b = torch.randn(6, 2), torch.randn(3, 4)
    base.remember_channel_major(a, b, 2)
    assert base.recall_channel_major(a, 2) is b
    assert base.recall_channel_major(a, 3) is None
    key = id(a)
    del a
    assert key not in base._CHANNEL_MAJOR
