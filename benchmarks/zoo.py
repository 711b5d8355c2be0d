"""The zoo of real model shapes: one definition each, shared by the fusion
benchmark (``benchmarks/fusion.py``) and the fusion tests
(``tests/fusion/test_fusion_zoo.py``).

Defaults are the benchmark's sizes; the tests pass smaller ones where they
use smaller models (e.g. ``ResNet18(width=4)``, ``PointNet(classes=5)``).
The models are plain ``torch.nn`` code; nothing here knows about fusion.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp() -> nn.Module:
    """The digits MLP shape (8x8 images), hidden 128."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def cnn() -> nn.Module:
    """The digits CNN shape: conv + BatchNorm + pooling on 8x8 images."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-shaped ResNet-18 (3x3 stem, [2, 2, 2, 2] basic blocks) at reduced width.

    Width 8 in the benchmark (full width 64 is out of reach for timing on a
    2-core CPU), 4 in the tests.
    """

    def __init__(self, width: int = 8, classes: int = 10) -> None:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1)
        return self.linear(out.view(out.size(0), -1))


class TransformerClassifier(nn.Module):
    """Token classifier: embedding, 2 encoder layers, padding mask, mean pooling."""

    def __init__(self, vocab: int = 1000, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.enc(self.emb(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class LSTMLM(nn.Module):
    """LSTM language model: next-token logits, returned as [N, V, T] for cross_entropy."""

    def __init__(self, vocab: int = 1000, d: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(self.emb(tokens))
        return self.out(y).transpose(1, 2)


class TNet(nn.Module):
    """PointNet's input transform: a k x k matrix per sample (identity + learned)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(nn.Conv1d(k, 16, 1), nn.BatchNorm1d(16), nn.ReLU())
        self.fc = nn.Linear(16, k * k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, k, P]
        feat = torch.max(self.conv(x), 2)[0]
        m = self.fc(feat) + torch.eye(self.k, dtype=x.dtype, device=x.device).flatten()
        return m.view(-1, self.k, self.k)


class PointNet(nn.Module):
    """PointNet classifier with an input transform (per-sample torch.bmm in forward).

    Input [N, 3, P] points; small widths (point MLP 3-16-32, head 32-16-classes).
    """

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.tnet = TNet(3)
        self.mlp = nn.Sequential(nn.Conv1d(3, 16, 1), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Conv1d(16, 32, 1), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.0),
                                  nn.Linear(16, classes))

    def forward(self, pts: torch.Tensor) -> torch.Tensor:  # [N, 3, P]
        pts = torch.bmm(self.tnet(pts), pts)
        return self.head(self.mlp(pts).max(dim=2).values)
