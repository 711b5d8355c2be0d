"""An array's data: one stream of mini-batches that every member of the array reads.

HFTA feeds every member of a fused model the same batch, so an array reads its data once
per step for all its members: the batch is moved to the device once and broadcast
(``fusion.broadcast``, a view per tensor). Where the batches come from depends on the
dataset the workload returns:

* a ``TensorDataset`` stays on the device and is indexed by a permutation drawn from the
  array's generator (no ``DataLoader``, no collation: the digits workloads' fast path); its
  validation set is one batch, the whole set;
* any other map-style or iterable ``Dataset`` is read through one
  ``torch.utils.data.DataLoader`` per array, with the array's batch size and generator and
  the workload's loader options (the study's over them): torch's sampler, collation,
  worker processes, pinning and prefetching.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol, TypeGuard

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from fusetune.workers.spec import TrainingSpec
from fusetune.workers.workloads import LOADER_OWNED, Batch, Params, Workload

__all__ = ["ArrayData", "Source", "is_tensor_dataset", "loader_options", "sample_batch", "samples_in"]

#: Arguments that only mean something with worker processes (torch refuses some without).
WORKER_ONLY = ("prefetch_factor", "persistent_workers")


def is_tensor_dataset(dataset: Dataset[Any]) -> TypeGuard[TensorDataset]:
    """Whether ``dataset`` is a plain ``TensorDataset`` (a subclass that overrides
    ``__getitem__``, to transform its samples, is read through a loader like any dataset)."""
    return isinstance(dataset, TensorDataset) and type(dataset).__getitem__ is TensorDataset.__getitem__


def loader_options(workload: Workload, training: TrainingSpec | None, device: torch.device) -> dict[str, Any]:
    """The ``DataLoader`` keyword arguments of the workload's loader on ``device``: the
    workload's ``loader``, the study's over it; ``pin_memory`` on by default on CUDA and off
    elsewhere; worker-only options dropped without worker processes.

    Raises:
        ValueError: an option names what the array sets (``batch_size``, ``generator``,
            ``sampler``, ``batch_sampler``).
    """
    options = {**workload.loader, **(training.loader if training is not None else {})}
    owned = sorted(LOADER_OWNED & set(options))
    if owned:
        raise ValueError(f"workload {workload.name!r}: loader options {owned} are the array's own (its batch size and seeded order)")
    if device.type == "cuda":
        options.setdefault("pin_memory", True)
    else:  # pinning is for copies to an accelerator; without one torch only warns
        options.pop("pin_memory", None)
        options.pop("pin_memory_device", None)
    if not options.get("num_workers"):
        for name in WORKER_ONLY:
            options.pop(name, None)
    return options


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    """``batch`` with every tensor in it on ``device`` (a copy from pinned memory may overlap)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=non_blocking), batch)


def samples_in(target: Any) -> int:
    """How many samples a batch holds: the first axis of its target's first tensor."""
    for leaf in pytree.tree_leaves(target):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ValueError("a batch's target holds no tensor with a sample axis")


class Source(Protocol):
    """Where an array's batches come from, on its device."""

    def epoch(self) -> Iterator[Batch]:
        """One pass in training order."""
        ...

    def in_order(self) -> Iterator[Batch]:
        """One pass in the dataset's order, for validation."""
        ...

    def endless(self, seed: int) -> Iterator[Batch]:
        """Training batches without end, drawn apart from the array's order (the solo probe)."""
        ...


class Tensors:
    """A ``TensorDataset`` on the device, read by index: no loader, no collation.

    A batch is the tuple of its tensors at the batch's indices (``(x, y)``).
    """

    def __init__(self, dataset: TensorDataset, device: torch.device, batch_size: int, generator: torch.Generator) -> None:
        self.tensors = tuple(t.to(device) for t in dataset.tensors)
        self.device, self.batch_size, self.generator = device, batch_size, generator
        self.size = len(self.tensors[0])

    def epoch(self) -> Iterator[Batch]:
        order = torch.randperm(self.size, generator=self.generator).to(self.device)
        for begin in range(0, self.size, self.batch_size):
            idx = order[begin : begin + self.batch_size]
            yield tuple(t[idx] for t in self.tensors)

    def in_order(self) -> Iterator[Batch]:
        yield self.tensors  # the whole set in one fused pass

    def endless(self, seed: int) -> Iterator[Batch]:
        # From the global RNG, which the probe seeds (it always has: a copy of the member
        # trains, from its own init seed).
        while True:
            idx = torch.randint(self.size, (self.batch_size,), device=self.device)
            yield tuple(t[idx] for t in self.tensors)


class Loaded:
    """A dataset read through a ``DataLoader``: ``DataLoader(dataset, batch_size,
    shuffle=True, generator=generator, **options)`` for training,
    ``shuffle=False, drop_last=False`` for validation, each batch moved to the device.

    ``shuffle`` applies to a map-style dataset only: a ``DataLoader`` cannot shuffle an
    iterable one, which yields its batches in its own order. The generator draws the
    sampler's permutation and, each time the loader is iterated (once, with persistent
    workers), its worker processes' ``base_seed``.
    """

    def __init__(self, dataset: Dataset[Any], device: torch.device, batch_size: int, generator: torch.Generator,
                 options: Mapping[str, Any], training: bool) -> None:
        self.dataset, self.device, self.batch_size, self.generator = dataset, device, batch_size, generator
        self.options = dict(options)
        if not training:  # the whole validation set, in order
            self.options.update(drop_last=False)
            self.options.pop("shuffle", None)
        if not isinstance(dataset, IterableDataset):
            self.options["shuffle"] = self.options.get("shuffle", True) and training
        self.loader: DataLoader[Any] | None = self._loader(generator, self.options)
        self.seed = generator.initial_seed()

    def _loader(self, generator: torch.Generator, options: Mapping[str, Any]) -> DataLoader[Any]:
        return DataLoader(self.dataset, batch_size=self.batch_size, generator=generator, **options)

    def _moved(self, loader: DataLoader[Any] | None) -> Iterator[Batch]:
        if loader is None:
            raise RuntimeError("the array's data was closed")
        non_blocking = bool(loader.pin_memory) and self.device.type == "cuda"
        for batch in loader:
            yield to_device(batch, self.device, non_blocking)

    def epoch(self) -> Iterator[Batch]:
        return self._moved(self.loader)

    def in_order(self) -> Iterator[Batch]:
        # Every pass from the same seed: the same batches (and worker seeds) every epoch.
        self.generator.manual_seed(self.seed)
        return self._moved(self.loader)

    def close(self) -> None:
        """Drop the loader: its worker processes end with its iterator (persistent ones too)."""
        self.loader = None

    def endless(self, seed: int) -> Iterator[Batch]:
        # A loader of its own: the array's order and workers stay as they are.
        options = {k: v for k, v in self.options.items() if k != "persistent_workers"}
        loader = self._loader(torch.Generator().manual_seed(seed), options)
        while True:
            empty = True
            for batch in self._moved(loader):
                empty = False
                yield batch
            if empty:
                raise ValueError("the training data yields no batch")


def source(dataset: Dataset[Any], device: torch.device, batch_size: int, generator: torch.Generator,
           options: Mapping[str, Any], training: bool) -> Tensors | Loaded:
    """How an array reads ``dataset``: by index on the device, or through a loader."""
    if is_tensor_dataset(dataset):
        return Tensors(dataset, device, batch_size, generator)
    return Loaded(dataset, device, batch_size, generator, options, training)


class ArrayData:
    """An array's training and validation data (``Workload.datasets()``) on its device.

    The training order is drawn from ``generator`` (the array's seed); the validation set
    is read in order, from a generator of its own seeded with ``seed`` every pass, so
    validation never moves the training order.
    """

    def __init__(self, workload: Workload, training: TrainingSpec | None, device: torch.device, batch_size: int,
                 generator: torch.Generator, seed: int) -> None:
        train, val = datasets_of(workload)
        options = loader_options(workload, training, device)
        self.train = source(train, device, batch_size, generator, options, training=True)
        self.val = source(val, device, batch_size, torch.Generator().manual_seed(seed), options, training=False)

    def epoch(self) -> Iterator[Batch]:
        """The training batches of one epoch."""
        return self.train.epoch()

    def validation(self) -> Iterator[Batch]:
        """The validation batches (a ``TensorDataset``'s whole set as one)."""
        return self.val.in_order()

    def first_validation(self) -> Batch:
        """The first validation batch (a ``TensorDataset``'s whole set)."""
        return next(iter(self.val.in_order()))

    def close(self) -> None:
        """Let the loaders' worker processes go (persistent ones live as long as their loader)."""
        for part in (self.train, self.val):
            if isinstance(part, Loaded):
                part.close()


def datasets_of(workload: Workload) -> tuple[Any, Any]:
    """``workload.datasets()``: its (train, validation) pair, or a ``TypeError`` saying what it
    returned instead (not the unpacking's "too many values to unpack")."""
    found = workload.datasets()
    if not isinstance(found, (tuple, list)) or len(found) != 2:
        what = f"a {type(found).__name__} of {len(found)}" if isinstance(found, (tuple, list)) else f"a {type(found).__name__}"
        raise TypeError(f"workload {workload.name!r}: datasets() returned {what}, not the pair (train, validation)")
    return found[0], found[1]


def sample_batch(workload: Workload, params: Params, training: TrainingSpec | None = None) -> Batch:
    """One training batch of the size a trial with ``params`` trains with, read in this
    process on the CPU (no worker processes): what sizing measures a training step on."""
    train, _ = datasets_of(workload)
    batch_size = workload.batch_size_for(params)
    if is_tensor_dataset(train):
        return tuple(t[:batch_size] for t in train.tensors)
    options = loader_options(workload, training, torch.device("cpu"))
    options = {k: v for k, v in options.items() if k not in ("num_workers", *WORKER_ONLY)}
    loader = Loaded(train, torch.device("cpu"), batch_size, torch.Generator().manual_seed(0), options, training=True)
    return next(loader.epoch())
