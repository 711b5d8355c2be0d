"""A zoo of real model shapes fused without any change to their code.

The models are defined once, in benchmarks/zoo.py, which the fusion benchmark
also uses; here at test sizes (ResNet-18 at width 4, PointNet with 5 classes).
The small Transformer encoder classifier and LSTM/GRU language models that
test batch-first/seq-first layouts live in test_fusion_layers.py; the digits
MLP and CNN in test_fusion_core.py.
"""

from __future__ import annotations

import torch
from _fusion_helpers import classification_batch, run_equivalence

import fusetune.fusion as fusion
from benchmarks.zoo import PointNet, ResNet18

B = 2


def resnet18():
    return ResNet18(width=4, classes=10)


def pointnet():
    return PointNet(classes=5)


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
    run_equivalence(resnet18, lambda b: classification_batch(b, 6, (3, 8, 8), 10, torch.float64), ref, fused, b=B)


def test_resnet18_float32():
    # 16 images of 16x16: BatchNorm at the 2x2 last stage then sees 64 values
    # per channel. With 8 images of 8x8 (8 values per channel) the float32
    # gradient of the stem conv is ill-conditioned enough that two correct
    # implementations differ by ~1e-4 (float64 agrees to 1e-10 either way).
    ref, fused = sgd_pair(B)
    run_equivalence(resnet18, lambda b: classification_batch(b, 16, (3, 16, 16), 10, torch.float32), ref, fused, b=B,
                    dtype=torch.float32)


def test_resnet18_adam():
    ref, fused = adam_pair(B)
    run_equivalence(resnet18, lambda b: classification_batch(b, 6, (3, 8, 8), 10, torch.float64), ref, fused, b=B)


def test_pointnet():
    ref, fused = sgd_pair(3)
    run_equivalence(pointnet, lambda b: classification_batch(b, 4, (3, 10), 5, torch.float64), ref, fused, b=3)
