"""Bring your own model: a residual CNN on CIFAR-shaped images, tuned by a fusetune service.

Everything here is plain PyTorch: a small ResNet (BatchNorm, Dropout, ``F.relu`` and
``F.adaptive_avg_pool2d`` in its forward), a map-style ``Dataset`` whose ``__getitem__``
augments each image (a random horizontal flip and a random crop of the image padded by 4,
drawn with torch's RNG, as torchvision's ``RandomHorizontalFlip`` and ``RandomCrop(32,
padding=4)`` draw them), and a define-by-run Optuna search space. ``create_study`` packages
the ``Workload`` (cloudpickled by value: this file travels with it) and the service trains
the trials whose models have the same shapes (the same ``width``) as one fused model.

The images are generated here, so nothing is downloaded: 3x32x32 images of 10 classes, each
class a colour and a stripe pattern (horizontal or vertical stripes, of one of five
frequencies) under a random phase, contrast and Gaussian noise. A flip or a shift keeps the
class. 2,000 training and 500 validation images: one epoch of one trial takes about half a
second on one CPU core, and a good trial is well above chance (10%) after an epoch.

Run it against a service (``make run`` starts one; see docs/examples/README.md)::

    python docs/examples/residual_cnn.py --url http://127.0.0.1:8000 --token $FUSETUNE_TOKEN
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from fusetune import Metric, Workload

CLASSES, SIZE, PAD = 10, 32, 4
TRAIN_IMAGES, VAL_IMAGES = 2000, 500


# -- data ------------------------------------------------------------------------------------------


def stripes(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One image per label: the class's colour times its stripes (label % 2: horizontal or
    vertical; label // 2: 2 to 6 periods across the image), at a random phase and contrast,
    plus noise. The colours are fixed (their own seed), the rest drawn from ``generator``."""
    n = len(labels)
    colours = torch.rand(CLASSES, 3, generator=torch.Generator().manual_seed(1234)) * 2 - 1
    periods = (2 + labels // 2).float()
    phase = torch.rand(n, generator=generator) * 2 * math.pi
    contrast = 0.4 + 0.8 * torch.rand(n, generator=generator)
    position = torch.arange(SIZE).float() / SIZE  # [SIZE]
    wave = torch.sin(2 * math.pi * periods[:, None] * position + phase[:, None])  # [n, SIZE]
    horizontal = (labels % 2 == 0)[:, None, None]
    pattern = torch.where(horizontal, wave[:, :, None].expand(n, SIZE, SIZE), wave[:, None, :].expand(n, SIZE, SIZE))
    images = contrast[:, None, None, None] * colours[labels][:, :, None, None] * pattern[:, None]
    return images + torch.randn(n, 3, SIZE, SIZE, generator=generator)


class StripedImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` generated images (made once from ``seed``), each read with a random
    horizontal flip and a random 32x32 crop of the image zero-padded by 4 when ``augment``."""

    def __init__(self, size: int, seed: int, augment: bool) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (size,), generator=generator)
        self.images = stripes(self.labels, generator)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
            top, left = torch.randint(0, 2 * PAD + 1, (2,)).tolist()
            image = F.pad(image, (PAD, PAD, PAD, PAD))[:, top : top + SIZE, left : left + SIZE]
        return image, self.labels[index]


def datasets() -> tuple[Dataset[Any], Dataset[Any]]:
    """The training set (augmented) and the validation set (as it is): called by the
    workers, never when the workload is built or packaged."""
    return StripedImages(TRAIN_IMAGES, seed=0, augment=True), StripedImages(VAL_IMAGES, seed=1, augment=False)


# -- model -----------------------------------------------------------------------------------------


class Block(nn.Module):
    """A residual block: two 3x3 convolutions with BatchNorm, added to its input (through a
    strided 1x1 convolution where the block changes the shape)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResidualCNN(nn.Module):
    """A strided stem (32x32 to 16x16), a block at ``width`` channels, a strided block at
    twice as many (8x8), global average pooling, dropout and a linear head."""

    def __init__(self, width: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.block1 = Block(width, width)
        self.block2 = Block(width, 2 * width, stride=2)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(2 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block2(self.block1(F.relu(self.bn(self.stem(x)))))
        h = torch.flatten(F.adaptive_avg_pool2d(h, 1), 1)
        return self.head(self.dropout(h))


def build_model(params: Any) -> nn.Module:
    """The trial's model. ``width`` sets its shapes (trials of one width fuse); ``dropout``
    is a per-member setting of a fused Dropout, so trials of any dropout fuse."""
    return ResidualCNN(int(params.get("width", 8)), float(params.get("dropout", 0.0)))


# -- what a trial tunes and measures -----------------------------------------------------------------


def search_space(trial: optuna.Trial) -> dict[str, Any]:
    """SGD's learning rate (log scale), momentum and weight decay, the dropout before the
    head, and the width (a categorical: one array per width)."""
    return {
        "lr": trial.suggest_float("lr", 1e-3, 0.3, log=True),
        "momentum": trial.suggest_float("momentum", 0.0, 0.95),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
        "dropout": trial.suggest_float("dropout", 0.0, 0.5),
        "width": trial.suggest_categorical("width", [8, 16]),
    }


def accuracy(output: torch.Tensor, target: torch.Tensor) -> float:
    """The fraction of images whose arg-max class is their class, over the whole set."""
    return float((output.argmax(dim=-1) == target).float().mean())


def mean_loss(output: torch.Tensor, target: torch.Tensor) -> float:
    """The batch's mean cross-entropy: a per-batch metric (a mean over samples)."""
    return float(F.cross_entropy(output, target))


WORKLOAD = Workload(
    name="example-residual-cnn",
    build_model=build_model,
    search_space=search_space,
    datasets=datasets,
    loss=F.cross_entropy,
    metric=accuracy,
    metric_name="accuracy",
    direction="maximize",
    metrics=(Metric("accuracy", accuracy), Metric("val_loss", mean_loss, "minimize", per_batch=True)),
    optimizer="SGD",
    optimizer_defaults={"lr": 0.05, "momentum": 0.9},
    batch_size=64,
    # The batches are read in the training process: the images are small and made in
    # memory, so worker processes would cost more than they save.
    loader={"num_workers": 0},
    description="residual CNN with BatchNorm and Dropout on augmented CIFAR-shaped images",
)


# -- the study ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", help="the service (default: FUSETUNE_URL, else http://127.0.0.1:8000)")
    parser.add_argument("--token", help="a tenant's token with code_upload (default: FUSETUNE_TOKEN)")
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="the TPE sampler's seed")
    parser.add_argument("--max-concurrent-trials", type=int, default=None,
                        help="trials asked and not finished at most (default: as many as the workers' arrays "
                             "take); on CPU workers a few per worker let TPE learn from finished trials at "
                             "little cost in speed (docs/byo-model.md)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the study")
    args = parser.parse_args(argv)

    from fusetune.client import Client, create_study

    study = create_study(
        workload=WORKLOAD, n_trials=args.trials, epochs=args.epochs, direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=args.seed), max_concurrent_trials=args.max_concurrent_trials,
        url=args.url, token=args.token,
    )
    print(f"study {study.study_name!r}: {args.trials} trials of {WORKLOAD.name}, {args.epochs} epochs each")
    return wait_and_report(Client(args.url, token=args.token), study, args.timeout)


def wait_and_report(client: Any, study: optuna.Study, timeout: float) -> int:
    """Follow the study on the service's event stream until it ends, then print its best trial."""
    started = time.monotonic()

    def progress(s: dict[str, Any]) -> None:
        c = s["trial_counts"]
        print(f"  {time.monotonic() - started:6.1f}s  {s['state']:<9} waiting {c['WAITING']:>3}  running {c['RUNNING']:>3}  "
              f"complete {c['COMPLETE']:>3}  pruned {c['PRUNED']:>3}  failed {c['FAIL']:>3}", flush=True)

    with client:
        (found,) = client.studies(name=study.study_name)
        try:
            ended = client.wait(found["id"], timeout=timeout, poll=5.0, on_poll=progress)
        except TimeoutError as exc:
            print(f"{exc}; it goes on training on the service (see the dashboard)")
            return 1
        for warning in ended.get("warnings") or ():
            print(f"warning: {warning}")
    print(f"study {ended['state']} in {time.monotonic() - started:.1f} s")
    completed = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    if not completed:
        print("no trial completed")
        return 1
    best = study.best_trial
    print(f"best trial #{best.number}: {WORKLOAD.metric_name} {best.value:.4f}")
    for name, value in best.params.items():
        print(f"  {name} = {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
