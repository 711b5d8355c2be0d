"""The residual CNN example at ResNet-18 size, for ``benchmarks/gpu.sh`` (``e2e.py --workload resnet18``).

The data, augmentation, loss, metrics and optimizer are ``docs/examples/residual_cnn.py``'s
(loaded by path, as ``benchmarks/e2e.py`` loads it); the model is a CIFAR ResNet-18: a 3x3
stem at full resolution, four stages of two basic blocks (the example's ``Block``) at
``width``, 2, 4 and 8 times ``width`` channels (strides 1, 2, 2, 2), global average pooling,
dropout and a linear head. ``width`` 64 is ResNet-18 (11.2M parameters); the space also
offers 32, so a sweep has two classes of trials, as the example's has.

It is loaded by path, and travels to the service the same way the example does: the client
cloudpickles it by value with both modules.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn

_EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "examples" / "residual_cnn.py"
_NAME = "fusetune_bench_residual_cnn"  # the name benchmarks/e2e.py loads it under


def _example() -> Any:
    module = sys.modules.get(_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(_NAME, _EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module
        spec.loader.exec_module(module)
    return module


rc = _example()


class ResNet18(nn.Module):
    def __init__(self, width: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        blocks: list[nn.Module] = []
        c_in = width
        for stage, stride in enumerate((1, 2, 2, 2)):
            c_out = width * 2**stage
            blocks += [rc.Block(c_in, c_out, stride), rc.Block(c_out, c_out)]
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(c_in, rc.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        h = torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)
        return self.head(self.dropout(h))


def build_model(params: Any) -> nn.Module:
    return ResNet18(int(params.get("width", 64)), float(params.get("dropout", 0.0)))


def search_space(trial: optuna.Trial) -> dict[str, Any]:
    """The example's space, with ResNet-18's widths."""
    return {
        "lr": trial.suggest_float("lr", 1e-3, 0.3, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.95),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
        "dropout": trial.suggest_float("dropout", 0.0, 0.5),
        "width": trial.suggest_categorical("width", [32, 64]),
    }


WORKLOAD = dataclasses.replace(
    rc.WORKLOAD,
    name="example-resnet18",
    build_model=build_model,
    search_space=search_space,
    description="ResNet-18 with BatchNorm and Dropout on augmented CIFAR-shaped images",
)
