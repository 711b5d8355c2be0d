"""Workloads of models as people write them, on generated data (nothing downloads).

A service's workers resolve them by path (``tests.people_workloads:POSITIONAL``, with
``FUSETUNE_ALLOW_WORKLOAD_IMPORTS``), as tests/unbuildable_workload.py's: a workload
registered in the test's process is not registered in the workers' processes.

* ``POSITIONAL``: a Transformer classifier whose learned positional ``nn.Parameter``
  (``self.pos``) is added to the embeddings: no twin owns it, so the root runs on fusion's
  batched path (vmap), fused.
* ``PER_MEMBER``: an MLP with a block that branches on ``.item()`` of its activations: vmap
  cannot run it, so that block runs once per member (fused, with a warning).
* ``UNFUSIBLE``: an MLP whose learnable temperature is kept in range in place and applied
  only when it is not one (``.item()``): vmap cannot run it (``.item()``), and neither can
  the per-member loop (an in-place write into one member's view of the stacked
  parameter): it fuses by neither path, and trains unfused.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fusetune.workers.workloads import Workload, accuracy

#: Sequences of LENGTH steps of FEATURES numbers; CLASSES classes.
LENGTH, FEATURES, CLASSES = 8, 4, 4


@lru_cache(maxsize=1)
def sequences() -> tuple[TensorDataset, TensorDataset]:
    """(train, validation): 192 and 64 random sequences, each labelled by the position of
    its largest first feature modulo 4 (a label only position tells)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, LENGTH, FEATURES, generator=generator)
    y = x[:, :, 0].argmax(dim=1) % CLASSES
    return TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])


class PositionalTransformer(nn.Module):
    """Embeddings plus a learned position table, one encoder layer, mean pooling, a head."""

    def __init__(self, d_model: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, d_model)
        self.pos = nn.Parameter(torch.randn(LENGTH, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1)
        self.head = nn.Linear(d_model, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos
        return self.head(self.encoder(h).mean(dim=1))


class Gate(nn.Module):
    """Scales its input by a learned gain, unless the input is all but silent (a Python
    branch on ``.item()``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().mean().item() < 1e-6:
            return x
        return x * self.gain


class Temperature(nn.Module):
    """A learnable temperature on the logits, kept in range in place (as CLIP clamps its
    logit scale), and skipped while it is one (a Python branch on ``.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_t = nn.Parameter(torch.full((), math.log(2.0)))

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.log_t.clamp_(-2.0, 2.0)
        if abs(self.log_t.item()) < 1e-8:
            return logits
        return logits * self.log_t.exp()


class SequenceMLP(nn.Module):
    """Flattened sequence, a hidden layer, ``block`` after it (or none), a head, then ``out``."""

    def __init__(self, hidden: int, block: nn.Module | None = None, out: nn.Module | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(LENGTH * FEATURES, hidden)
        self.block = block if block is not None else nn.Identity()
        self.head = nn.Linear(hidden, CLASSES)
        self.out = out if out is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.head(self.block(F.relu(self.inp(x.flatten(1))))))


def lr_space(trial: optuna.Trial) -> dict[str, Any]:
    """Only the learning rate: every trial of a study is of one class (one fused array)."""
    return {"lr": trial.suggest_float("lr", 1e-3, 3e-2, log=True)}


def _workload(name: str, build: Any, description: str) -> Workload:
    return Workload(
        name=name,
        build_model=build,
        search_space=lr_space,
        datasets=sequences,
        loss=F.cross_entropy,
        metric=accuracy,
        optimizer="AdamW",
        optimizer_defaults={"lr": 1e-2},
        batch_size=32,
        description=description,
    )


POSITIONAL = _workload(
    "positional-transformer", lambda params: PositionalTransformer(), "Transformer with a learned position nn.Parameter"
)
PER_MEMBER = _workload(
    "gated-mlp", lambda params: SequenceMLP(32, block=Gate(32)), "MLP with a block that branches on .item()"
)
UNFUSIBLE = _workload(
    "temperature-mlp", lambda params: SequenceMLP(32, out=Temperature()), "MLP with an in-place clamped temperature"
)
