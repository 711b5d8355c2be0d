"""Two real workloads on scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import optuna
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ._base import Metric, Params, Workload, accuracy, n_params

#: Images held out for validation; the split is fixed so every trial sees the same data.
VALIDATION_SIZE = 360
SPLIT_SEED = 0


@lru_cache(maxsize=1)
def digits_datasets() -> tuple[TensorDataset, TensorDataset]:
    """The fixed (train, validation) split: images ``[N, 1, 8, 8]`` in [0, 1], labels ``[N]``."""
    # scikit-learn is imported here, not with the module: it is half of what a worker process
    # imports (1.8 of 3.7 s), and a worker that never trains digits (an uploaded workload's,
    # most of a service's four at start-up) never needs it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = train_test_split(
        list(range(len(labels))),
        test_size=VALIDATION_SIZE,
        random_state=SPLIT_SEED,
        stratify=digits.target,
    )
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[val_idx], labels[val_idx]),
    )


def build_mlp(params: Params) -> nn.Module:
    """A two-hidden-layer perceptron over the 64 pixels."""
    hidden = int(params.get("hidden", 64))
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, hidden),
        nn.ReLU(),
        nn.Dropout(float(params.get("dropout", 0.0))),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


#: What a digits study may choose as objectives: accuracy (the default) and the model's size,
#: so a study can ask for the accuracy/size Pareto front.
DIGITS_METRICS = (
    Metric("accuracy", accuracy, "maximize"),
    Metric("n_params", n_params, "minimize", of="model"),
)


def mlp_space(trial: optuna.Trial) -> dict[str, Any]:
    """lr, momentum and weight decay are fusible; the hidden width changes the shapes."""
    return {
        "lr": trial.suggest_float("lr", 1e-3, 0.3, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.95),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
        "hidden": trial.suggest_categorical("hidden", [32, 64]),
    }


class DigitsCNN(nn.Module):
    """A small conv + BatchNorm network; its forward uses ``torch.flatten`` as users write it."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def build_cnn(params: Params) -> nn.Module:
    return DigitsCNN(channels=int(params.get("channels", 16)))


def cnn_space(trial: optuna.Trial) -> dict[str, Any]:
    return {
        "lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-3, log=True),
        "channels": trial.suggest_categorical("channels", [8, 16]),
    }


DIGITS_MLP = Workload(
    name="digits-mlp",
    build_model=build_mlp,
    search_space=mlp_space,
    datasets=digits_datasets,
    loss=F.cross_entropy,
    metric=accuracy,
    metrics=DIGITS_METRICS,
    optimizer="SGD",
    optimizer_defaults={"lr": 0.05},
    batch_size=64,
    description="MLP on scikit-learn's 8x8 digits, SGD with momentum",
)

DIGITS_CNN = Workload(
    name="digits-cnn",
    build_model=build_cnn,
    search_space=cnn_space,
    datasets=digits_datasets,
    loss=F.cross_entropy,
    metric=accuracy,
    metrics=DIGITS_METRICS,
    optimizer="Adam",
    optimizer_defaults={"lr": 1e-3},
    batch_size=64,
    description="Conv + BatchNorm network on scikit-learn's 8x8 digits, Adam",
)
