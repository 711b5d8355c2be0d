"""fallback=True: modules without a fused twin run once per member, exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusetune.fusion as fusion
from _fusion_helpers import run_equivalence

B = 3
SGD_KW = dict(lr=[0.1, 0.05, 0.02], momentum=[0.9, 0.0, 0.5])


def sgd():
    return (lambda i, m: torch.optim.SGD(m.parameters(), **{k: v[i] for k, v in SGD_KW.items()}),
            lambda f: fusion.optim.SGD(f.parameters(), **SGD_KW))


class ScaledBlock(nn.Module):
    """A user block with its own parameter and a BatchNorm child."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(x) * self.scale[:, None]


class WithFallbacks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.block = ScaledBlock()
        self.rnn = nn.RNN(6, 5, batch_first=False)
        self.out = nn.Linear(5, 3)

    def forward(self, x):  # x [N, T, 4]
        h = self.block(self.inp(x).transpose(1, 2)).transpose(1, 2)  # BatchNorm1d over [N, 6, T]
        y, h_n = self.rnn(h.transpose(0, 1))  # seq-first RNN: [T, N, 5], h_n [1, N, 5]
        return self.out(y.mean(0) + h_n[0])


def batch(b):
    return torch.randn(b, 4, 7, 4, dtype=torch.float64), torch.randint(0, 3, (b, 4))


def test_fallback_equivalence_and_warning():
    with pytest.warns(fusion.FusionWarning, match=r"'block' \(ScaledBlock\), submodule 'rnn' \(RNN\)"):
        ref, fused = sgd()
        f = run_equivalence(WithFallbacks, batch, ref, fused, b=B, fallback=True)
    assert type(f.module.block).__name__ == "PerMemberScaledBlock"
    assert f.module.rnn.arg_axes == [1] and f.module.rnn.out_axes == [1, 1]


def test_fallback_off_by_default():
    with pytest.raises(fusion.FusionError, match=r"'block' \(ScaledBlock\).*fallback=True"):
        fusion.fuse([WithFallbacks() for _ in range(2)])


class RootParam(nn.Module):
    """Parameters owned by the root (a learned offset used in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x + self.offset)


def test_root_fallback_and_membership():
    with pytest.warns(fusion.FusionWarning, match="<root>"):
        ref, fused = sgd()
        run_equivalence(RootParam, lambda b: (torch.randn(b, 5, 4, dtype=torch.float64),
                                              torch.randint(0, 3, (b, 5))), ref, fused, b=B, fallback=True)
    torch.manual_seed(0)
    models = [WithFallbacks().double() for _ in range(3)]
    with pytest.warns(fusion.FusionWarning):
        f = fusion.fuse(models, fallback=True)
    x = torch.randn(3, 4, 7, 4, dtype=torch.float64)
    f(x)  # train mode: updates each member's BatchNorm statistics, as below
    for b, m in enumerate(models):
        m(x[b])
    f.remove_members([0])
    f.eval()
    new = WithFallbacks().double()
    with pytest.warns(fusion.FusionWarning):
        f.add_members([new])
    x = x[[1, 2, 0]]
    with torch.no_grad():
        out = f(x)
        for b, m in enumerate([models[1], models[2], new]):
            m.eval()
            torch.testing.assert_close(out[b], m(x[b]), rtol=1e-10, atol=1e-12)
