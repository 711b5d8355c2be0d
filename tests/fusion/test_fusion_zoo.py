"""A zoo of real model shapes fused without any change to their code.

The Transformer encoder classifier and the LSTM language model live in
test_fusion_layers.py; the digits MLP and CNN in test_fusion_core.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fusion
from _fusion_helpers import classification_batch, run_equivalence

B = 2


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-shaped ResNet-18 (3x3 stem, [2, 2, 2, 2] basic blocks) at reduced width."""

    def __init__(self, width: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers = []
        cin = width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.linear = nn.Linear(cin, classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1)
        out = out.view(out.size(0), -1)
        return self.linear(out)


class TNet(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(nn.Conv1d(k, 16, 1), nn.BatchNorm1d(16), nn.ReLU())
        self.fc = nn.Linear(16, k * k)

    def forward(self, x):  # [N, k, P]
        feat = torch.max(self.conv(x), 2)[0]
        m = self.fc(feat) + torch.eye(self.k, dtype=x.dtype).flatten()
        return m.view(-1, self.k, self.k)


class PointNet(nn.Module):
    """PointNet classifier with an input transform (per-sample torch.bmm in forward)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.tnet = TNet(3)
        self.mlp = nn.Sequential(nn.Conv1d(3, 16, 1), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Conv1d(16, 32, 1), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.0),
                                  nn.Linear(16, classes))

    def forward(self, pts):  # [N, 3, P]
        pts = torch.bmm(self.tnet(pts), pts)
        return self.head(self.mlp(pts).max(dim=2).values)


def sgd_pair(b: int):
    lrs = [0.05, 0.02, 0.1][:b]
    mom = [0.9, 0.5, 0.0][:b]
    return (lambda i, m: torch.optim.SGD(m.parameters(), lr=lrs[i], momentum=mom[i], weight_decay=5e-4),
            lambda f: fusion.optim.SGD(f.parameters(), lr=lrs, momentum=mom, weight_decay=5e-4))


def adam_pair(b: int):
    lrs = [1e-2, 3e-3, 2e-2][:b]
    return (lambda i, m: torch.optim.Adam(m.parameters(), lr=lrs[i]),
            lambda f: fusion.optim.Adam(f.parameters(), lr=lrs))


def test_resnet18_sgd():
    ref, fused = sgd_pair(B)
    run_equivalence(ResNet18, lambda b: classification_batch(b, 6, (3, 8, 8), 10, torch.float64), ref, fused, b=B)


def test_resnet18_float32():
    # 16 images of 16x16: BatchNorm at the 2x2 last stage then sees 64 values
    # per channel. With 8 images of 8x8 (8 values per channel) the float32
    # gradient of the stem conv is ill-conditioned enough that two correct
    # implementations differ by ~1e-4 (float64 agrees to 1e-10 either way).
    ref, fused = sgd_pair(B)
    run_equivalence(ResNet18, lambda b: classification_batch(b, 16, (3, 16, 16), 10, torch.float32), ref, fused, b=B,
                    dtype=torch.float32)


def test_resnet18_adam():
    ref, fused = adam_pair(B)
    run_equivalence(ResNet18, lambda b: classification_batch(b, 6, (3, 8, 8), 10, torch.float64), ref, fused, b=B)


def test_pointnet():
    ref, fused = sgd_pair(3)
    run_equivalence(PointNet, lambda b: classification_batch(b, 4, (3, 10), 5, torch.float64), ref, fused, b=3)
