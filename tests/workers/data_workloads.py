"""Workloads whose data is as researchers have it (issue 31, item 4), on generated data.

* ``CIFAR_RESNET``: a small residual CNN with BatchNorm on CIFAR-shaped images (3x32x32) from
  a map-style ``Dataset`` whose ``__getitem__`` augments each sample (a random horizontal
  flip and a random crop of the padded image, drawn with torch's RNG), read by two loader
  worker processes; accuracy over the whole validation set, the loss as a mean over batches.
* ``MASKED_LM``: a BERT-style masked language model on an ``IterableDataset`` that streams
  dict samples (``input_ids`` with 15% of the positions masked, ``labels`` -100 elsewhere):
  the loss is the masked positions' cross-entropy.
* ``CAUSAL_LM`` / ``CAUSAL_LM_TOKENS``: a Transformer language model (HFTA's case) whose loss
  is the next token's cross-entropy over the sequence: the batch is a dict of
  ``input_ids``/``labels``, or the token tensor itself. Per-token loss and accuracy are
  means over validation batches (``Metric.per_batch``).

Each is plain PyTorch: ``datasets``, ``loss`` and metrics, with the default ``forward`` and
``target_of`` (``model(x)`` and ``y`` of a tuple; a dict's entries but ``labels`` as keyword
arguments and its ``labels``; a tensor and itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optuna
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from fusetune.workers.workloads import Metric, Params, Workload, accuracy

IMAGE, CLASSES = (3, 32, 32), 10
VOCAB, LENGTH = 11, 12  # token ids 0..9, and MASK
MASK = VOCAB - 1


class AugmentedImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """CIFAR-shaped images made once from a seed (a class-dependent colour plus noise), each
    read with a random horizontal flip and a random 32x32 crop of the image padded by 4, as
    torchvision's ``RandomHorizontalFlip`` and ``RandomCrop(32, padding=4)`` draw them."""

    def __init__(self, size: int, seed: int, augment: bool) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (size,), generator=generator)
        colours = torch.randn(CLASSES, 3, 1, 1, generator=torch.Generator().manual_seed(1))
        self.images = colours[self.labels] + 0.5 * torch.randn(size, *IMAGE, generator=generator)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = F.pad(image, (4, 4, 4, 4))[:, top : top + 32, left : left + 32]
        return image, self.labels[index]


def cifar_datasets() -> tuple[Dataset[Any], Dataset[Any]]:
    """96 augmented training images, 40 validation images as they are (two batches of 32: the
    second one short)."""
    return AugmentedImages(96, seed=0, augment=True), AugmentedImages(40, seed=1, augment=False)


class Block(nn.Module):
    """A residual block: two 3x3 convolutions with BatchNorm, added to its input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class ResidualCNN(nn.Module):
    """A stem, two residual blocks with a pooling between, global pooling and a linear head."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block1, self.block2 = Block(width), Block(width)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block2(F.max_pool2d(self.block1(self.stem(x)), 2))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


def mean_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> float:
    """The batch's mean cross-entropy."""
    return float(F.cross_entropy(output, target))


def cnn_space(trial: optuna.Trial) -> dict[str, Any]:
    return {"lr": trial.suggest_float("lr", 1e-3, 0.1, log=True), "width": trial.suggest_categorical("width", [8])}


CIFAR_RESNET = Workload(
    name="test-cifar-resnet",
    build_model=lambda params: ResidualCNN(int(params.get("width", 8))),
    search_space=cnn_space,
    datasets=cifar_datasets,
    loss=F.cross_entropy,
    metric=accuracy,
    metrics=(Metric("accuracy", accuracy), Metric("loss", mean_cross_entropy, "minimize", per_batch=True)),
    optimizer="SGD",
    optimizer_defaults={"lr": 0.05, "momentum": 0.9},
    batch_size=32,
    loader={"num_workers": 2, "persistent_workers": True},
    description="residual CNN with BatchNorm on augmented CIFAR-shaped images",
)


def counting(start: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Sequences ``start, start + step, ...`` modulo 10: one per (start, step)."""
    return (start.unsqueeze(-1) + step.unsqueeze(-1) * torch.arange(LENGTH)) % 10


class MaskedSequences(IterableDataset[dict[str, torch.Tensor]]):
    """A stream of counting sequences masked as BERT's pretraining masks them: 15% of the
    positions (at least one) become MASK, and the labels keep the token there, -100 (ignored)
    elsewhere. Each pass over it (an epoch) draws new sequences and masks from its own
    seeded generator, so the stream is the same for any reader that starts it afresh."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.passes = size, seed, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.passes += 1
        generator = torch.Generator().manual_seed(1000 * self.seed + self.passes)
        for _ in range(self.size):
            start, step = torch.randint(0, 10, (2,), generator=generator)
            tokens = counting(start, step)
            masked = torch.rand(LENGTH, generator=generator) < 0.15
            masked[torch.randint(0, LENGTH, (1,), generator=generator)] = True
            yield {"input_ids": tokens.masked_fill(masked, MASK), "labels": tokens.masked_fill(~masked, -100)}


class Encoder(nn.Module):
    """Token embeddings plus a learned position table, one Transformer encoder layer, a head
    over the vocabulary; ``causal``: each position attends to the ones before it only."""

    def __init__(self, d_model: int = 16, causal: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(LENGTH, d_model) * 0.02)
        self.layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d_model, VOCAB)
        self.causal = causal
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(LENGTH), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos
        h = self.layer(h, src_mask=self.mask) if self.causal else self.layer(h)
        return self.head(h)


def masked_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The masked positions' mean cross-entropy (labels -100 elsewhere are ignored)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def masked_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The fraction of masked positions whose token is predicted."""
    counted = labels != -100
    return ((logits.argmax(-1) == labels) & counted).sum() / counted.sum()


def lm_space(trial: optuna.Trial) -> dict[str, Any]:
    return {"lr": trial.suggest_float("lr", 1e-2, 0.3, log=True)}


MASKED_LM = Workload(
    name="test-masked-lm",
    build_model=lambda params: Encoder(),
    search_space=lm_space,
    datasets=lambda: (MaskedSequences(64, seed=0), MaskedSequences(24, seed=1)),
    loss=masked_loss,
    metric=masked_accuracy,
    metric_name="masked_accuracy",
    metrics=(Metric("masked_accuracy", masked_accuracy, per_batch=True),),
    # SGD: an attention's key bias has no gradient but rounding noise, which Adam's
    # normalised step makes lr-sized, so fused and plain Adam differ there by design.
    optimizer="SGD",
    optimizer_defaults={"lr": 0.1, "momentum": 0.9},
    batch_size=16,
    description="BERT-style masked LM on a stream of masked sequences",
)


class TokenSequences(Dataset[Any]):
    """Counting sequences of every (start, step), as a dict of ``input_ids`` and ``labels``
    (the same tokens: the loss shifts them), or as the token tensor itself."""

    def __init__(self, steps: range, as_dict: bool) -> None:
        starts, strides = torch.meshgrid(torch.arange(10), torch.tensor(list(steps)), indexing="ij")
        self.tokens = counting(starts.flatten(), strides.flatten())
        self.as_dict = as_dict

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> Any:
        tokens = self.tokens[index]
        return {"input_ids": tokens, "labels": tokens} if self.as_dict else tokens


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Every position's cross-entropy of the token after it (HFTA's Transformer LM loss)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The batch's mean next-token loss."""
    return float(next_token_loss(logits, labels))


def token_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The fraction of positions whose next token is predicted."""
    return (logits[:, :-1].argmax(-1) == labels[:, 1:]).float().mean()


def _causal_lm(name: str, as_dict: bool) -> Workload:
    return Workload(
        name=name,
        build_model=lambda params: Encoder(int(params.get("d_model", 16)), causal=True),
        search_space=lm_space,
        # 10 starts x 7 steps for training, 10 x 2 others for validation.
        datasets=lambda: (TokenSequences(range(1, 8), as_dict), TokenSequences(range(8, 10), as_dict)),
        loss=next_token_loss,
        metric=token_accuracy,
        metric_name="token_accuracy",
        metrics=(
            Metric("token_accuracy", token_accuracy, per_batch=True),
            Metric("token_loss", token_loss, "minimize", per_batch=True),
        ),
        optimizer="SGD",  # as MASKED_LM's
        optimizer_defaults={"lr": 0.1, "momentum": 0.9},
        batch_size=16,
        description="Transformer language model on counting sequences",
    )


CAUSAL_LM = _causal_lm("test-causal-lm", as_dict=True)
CAUSAL_LM_TOKENS = _causal_lm("test-causal-lm-tokens", as_dict=False)
WORKLOADS = (CIFAR_RESNET, MASKED_LM, CAUSAL_LM, CAUSAL_LM_TOKENS)


def params_of(workload: Workload, n: int) -> Params:
    """Member ``n``'s params: its own learning rate."""
    return {"lr": workload.optimizer_defaults["lr"] * (1 + n) / 2}
