"""Data as researchers have it, through the worker's real training loop (``train_array``).

A map-style dataset with per-sample augmentation read by loader worker processes, an
iterable dataset of dict samples (a BERT-style masked model) and a Transformer language
model fed dict batches or token tensors each train fused, and every member ends with the
weights of its model trained by a plain torch loop over the same batches: the array's
``DataLoader`` is the one its ``Workload`` docstring spells out, so the loop builds its twin.
Their validation values are their plain models' over the whole validation set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import fusetune.fusion as fusion
from fusetune.workers.data import ArrayData, is_tensor_dataset, loader_options, sample_batch
from fusetune.workers.evaluation import Evaluation
from fusetune.workers.memory import array_memory_model
from fusetune.workers.optimization import resolve
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec, TrainingSpec
from fusetune.workers.training import train_array
from fusetune.workers.workloads import Metric, Workload, accuracy, register_workload
from fusetune.workers.workloads._registry import _registered
from tests import people_workloads as people
from tests.workers import data_workloads as data
from tests.workers.data_workloads import CAUSAL_LM, CAUSAL_LM_TOKENS, CIFAR_RESNET, MASKED_LM

SEED = 11


class Listed(Dataset[Any]):
    """A ``TensorDataset``'s samples as a plain map-style dataset: read through a loader."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]


def _listed(datasets: Callable[[], tuple[Any, Any]]) -> Callable[[], tuple[Any, Any]]:
    return lambda: tuple(Listed(d) for d in datasets())  # type: ignore[return-value]


UNFUSIBLE_LOADED = dataclasses.replace(people.UNFUSIBLE, name="temperature-mlp-loaded", datasets=_listed(people.sequences))


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    """The test workloads, in this process (train_array runs here)."""
    workloads = [*data.WORKLOADS, UNFUSIBLE_LOADED]
    for workload in workloads:
        register_workload(workload)
    try:
        yield
    finally:
        for workload in workloads:
            _registered.pop(workload.name, None)


def spec(workload: Workload, members: int, tmp_path: Path, *, epochs: int = 2, training: TrainingSpec = TrainingSpec(),
         probe_solo: bool = False) -> ArraySpec:
    return ArraySpec(
        array_id=1, signature="s", study_name="study", workload=workload.name, epochs=epochs,
        members=tuple(MemberSpec(100 + n, n, n, dict(data.params_of(workload, n))) for n in range(members)),
        seed=SEED, artifact_dir=str(tmp_path), checkpoint_interval_s=0.0, training=training, probe_solo=probe_solo,
    )


def run(array: ArraySpec) -> tuple[list[EpochReport], ArrayOutcome]:
    """Drive ``train_array`` as the control plane does, every report recorded."""
    training = train_array(array, torch.device("cpu"))
    reports: list[EpochReport] = []
    try:
        reports.append(next(training))
        while True:
            reports.append(training.send(EpochReply()))
    except StopIteration as stop:
        return reports, stop.value


def plain_models(workload: Workload, array: ArraySpec) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """Each member's model as the worker initialises it (the study's seed plus its number),
    with torch's own optimizer of its recipe."""
    models, optimizers = [], []
    for member in array.members:
        torch.manual_seed(array.seed + member.number)
        model = workload.build_model(member.params)
        models.append(model)
        optimizers.append(resolve(workload, None, member.params).torch_optimizer(model.parameters()))
    return models, optimizers


def train_plain(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], loss: torch.Tensor, k: int) -> None:
    """One plain step of model ``k`` (its loss computed on the batch by the caller)."""
    optimizers[k].zero_grad()
    loss.backward()
    optimizers[k].step()


def assert_members_are(tmp_path: Path, array: ArraySpec, models: Sequence[nn.Module], rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Every member's saved weights (buffers included) are its plain model's."""
    for member, model in zip(array.members, models, strict=True):
        saved = torch.load(tmp_path / "study" / f"trial-{member.number}.pt", weights_only=True)
        assert saved.keys() == model.state_dict().keys()
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(saved[name], tensor, rtol=rtol, atol=atol, msg=f"member {member.number}: {name}")


def finals(reports: Sequence[EpochReport]) -> dict[int, tuple[float, ...]]:
    """Each completed member's objectives, by trial id."""
    return {r.trial_id: r.values for report in reports for r in report.members if r.state == "COMPLETE"}


def test_a_map_style_dataset_with_augmentation_trains_fused_as_plain_torch_does(tmp_path: Path) -> None:
    """The residual CNN with BatchNorm on augmented CIFAR-shaped images, read by two
    persistent loader workers: the flips and crops are drawn in the worker processes, seeded
    from the array's generator, so the plain loop's loader of the same seed reads the same
    augmented batches, and the members' weights and BatchNorm statistics are its models'."""
    array = spec(CIFAR_RESNET, 3, tmp_path, training=TrainingSpec(metrics=("accuracy", "loss")))
    reports, outcome = run(array)
    assert outcome.error is None and sorted(outcome.completed) == [100, 101, 102]
    assert [r.size for r in reports] == [3, 3]

    models, optimizers = plain_models(CIFAR_RESNET, array)
    train, val = CIFAR_RESNET.datasets()
    loader = DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(SEED),
                        num_workers=2, persistent_workers=True)
    for _ in range(2):
        for x, y in loader:
            for k, model in enumerate(models):
                model.train()
                train_plain(models, optimizers, F.cross_entropy(model(x), y), k)
    assert_members_are(tmp_path, array, models)

    # Accuracy over the whole validation set (its two batches' outputs joined); the loss
    # as the mean of its batches' weighted by their samples, which is the set's mean.
    values = finals(reports)
    assert isinstance(val, data.AugmentedImages)
    for k, model in enumerate(models):
        with torch.no_grad():
            logits = model.eval()(val.images)
        accuracy_k, loss_k = values[100 + k]
        assert accuracy_k == pytest.approx(accuracy(logits, val.labels), abs=1.01 / len(val))
        assert loss_k == pytest.approx(float(F.cross_entropy(logits, val.labels)), rel=1e-4)


def test_an_iterable_dataset_of_dict_samples_trains_a_masked_model_fused(tmp_path: Path) -> None:
    """A BERT-style masked model on a stream of dict samples: its own order (a loader cannot
    shuffle an iterable), the masked positions' loss per member, a fresh stream per epoch."""
    array = spec(MASKED_LM, 2, tmp_path)
    reports, outcome = run(array)
    assert outcome.error is None and sorted(outcome.completed) == [100, 101]

    models, optimizers = plain_models(MASKED_LM, array)
    train, val = MASKED_LM.datasets()
    loader = DataLoader(train, batch_size=16, generator=torch.Generator().manual_seed(SEED))
    for _ in range(2):
        for batch in loader:
            assert batch.keys() == {"input_ids", "labels"}
            for k, model in enumerate(models):
                model.train()
                train_plain(models, optimizers, data.masked_loss(model(input_ids=batch["input_ids"]), batch["labels"]), k)
    assert_members_are(tmp_path, array, models)

    # The last epoch's validation read the stream's second pass (new masks each pass), in
    # batches of 16 and 8: its value is their masked accuracies weighted by their sequences.
    list(val)
    batches = list(DataLoader(val, batch_size=16))
    assert [len(b["labels"]) for b in batches] == [16, 8]
    fewest = min(int((b["labels"] != -100).sum()) for b in batches)
    values = finals(reports)
    for k, model in enumerate(models):
        with torch.no_grad():
            means = [float(data.masked_accuracy(model.eval()(b["input_ids"]), b["labels"])) for b in batches]
        assert values[100 + k][0] == pytest.approx((16 * means[0] + 8 * means[1]) / 24, abs=1.01 / fewest)


@pytest.mark.parametrize("workload", [CAUSAL_LM, CAUSAL_LM_TOKENS], ids=["dict", "tokens"])
def test_a_transformer_language_model_trains_fused_on_its_next_token_loss(tmp_path: Path, workload: Workload) -> None:
    """The loss shifts the labels (or the tokens themselves) by one position: the default
    forward feeds the dict's ``input_ids`` as a keyword (or the tensor), the default target
    is its ``labels`` (or the tensor). Per-token accuracy and loss are means over validation
    batches, never holding the whole set's logits."""
    array = spec(workload, 3, tmp_path, training=TrainingSpec(metrics=("token_accuracy", "token_loss")))
    reports, outcome = run(array)
    assert outcome.error is None and sorted(outcome.completed) == [100, 101, 102]

    models, optimizers = plain_models(workload, array)
    train, val = workload.datasets()
    loader = DataLoader(train, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    for _ in range(2):
        for batch in loader:
            tokens = batch["input_ids"] if isinstance(batch, dict) else batch
            for k, model in enumerate(models):
                model.train()
                train_plain(models, optimizers, data.next_token_loss(model(tokens), tokens), k)
    assert_members_are(tmp_path, array, models)

    assert isinstance(val, data.TokenSequences)
    values = finals(reports)
    for k, model in enumerate(models):
        with torch.no_grad():
            logits = model.eval()(val.tokens)
        token_accuracy, token_loss = values[100 + k]
        # Sequences of one length: the batches' means weighted by sequences are the set's.
        assert token_accuracy == pytest.approx(float(data.token_accuracy(logits, val.tokens)), abs=1.01 / val.tokens[:, 1:].numel())
        assert token_loss == pytest.approx(data.token_loss(logits, val.tokens), rel=1e-4)


def test_the_solo_probe_and_the_memory_model_read_a_loaders_batches(tmp_path: Path) -> None:
    """The unfused probe trains on batches of a loader of its own; sizing measures a step on
    the first training batch (a dict, through the workload's forward)."""
    reports, outcome = run(spec(CAUSAL_LM, 2, tmp_path, epochs=1, probe_solo=True))
    assert outcome.error is None
    assert reports[0].solo_steps_per_s is not None and reports[0].solo_steps_per_s > 0
    batch = sample_batch(CAUSAL_LM, {"lr": 1e-3})
    assert isinstance(batch, dict) and batch["input_ids"].shape == (16, data.LENGTH)
    base, member = array_memory_model(CAUSAL_LM, {"lr": 1e-3})
    wider_base, wider = array_memory_model(CAUSAL_LM, {"lr": 1e-3, "d_model": 32})
    assert base >= 0 and 0 < member < wider
    x, y = sample_batch(CIFAR_RESNET, {})
    assert x.shape == (32, *data.IMAGE) and y.shape == (32,)
    assert array_memory_model(CIFAR_RESNET, {})[1] > 0


def test_a_model_that_fuses_by_neither_path_is_found_out_on_a_loaders_data(tmp_path: Path) -> None:
    """The fusion check trains the first member's plain model on the loader's batch and
    evaluates it on the first validation batch: its members come back untrained, not failed."""
    reports, outcome = run(spec(UNFUSIBLE_LOADED, 2, tmp_path))
    assert reports == [] and outcome.failed == {}
    assert outcome.unfusible is not None and outcome.unfusible.startswith("submodule 'out' (Temperature)")


def test_loader_options_are_the_workloads_the_studys_over_them() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    workload = dataclasses.replace(CIFAR_RESNET, loader={"num_workers": 2, "prefetch_factor": 4, "pin_memory": True})
    assert loader_options(workload, None, cpu) == {"num_workers": 2, "prefetch_factor": 4}
    assert loader_options(workload, None, cuda)["pin_memory"] is True
    assert loader_options(MASKED_LM, None, cuda) == {"pin_memory": True}  # pinned by default on CUDA
    # The study's num_workers 0: no worker processes, so nothing that only they take.
    assert loader_options(workload, TrainingSpec(loader={"num_workers": 0}), cpu) == {"num_workers": 0}
    with pytest.raises(ValueError, match=r"\['batch_size', 'sampler'\]"):
        loader_options(dataclasses.replace(CIFAR_RESNET, loader={"sampler": None, "batch_size": 8}), None, cpu)
    stored = TrainingSpec(loader={"num_workers": 3}).to_json()
    assert TrainingSpec.from_json(stored).loader == {"num_workers": 3}


def test_only_a_plain_tensor_dataset_is_indexed_on_the_device() -> None:
    """A TensorDataset subclass that transforms its samples is read through a loader, so
    its ``__getitem__`` runs."""

    class Noisy(TensorDataset):
        def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
            x, y = super().__getitem__(index)
            return x + 1000.0, y

    x, y = torch.zeros(10, 3), torch.arange(10)
    assert is_tensor_dataset(TensorDataset(x, y)) and not is_tensor_dataset(Noisy(x, y))
    workload = dataclasses.replace(CIFAR_RESNET, datasets=lambda: (Noisy(x, y), TensorDataset(x, y)), batch_size=4, loader={})
    arrays = ArrayData(workload, None, torch.device("cpu"), 4, torch.Generator().manual_seed(0), 0)
    batches = list(arrays.epoch())
    assert [len(b[1]) for b in batches] == [4, 4, 2] and all(bool((b[0] == 1000.0).all()) for b in batches)
    assert sorted(torch.cat([b[1] for b in batches]).tolist()) == list(range(10))
    (whole,) = list(arrays.validation())  # the TensorDataset's whole set, one batch, no loader
    assert torch.equal(whole[0], x) and torch.equal(whole[1], y)


def test_a_dict_batch_is_broadcast_tensor_by_tensor_and_a_loss_may_read_all_of_it() -> None:
    """``fusion.broadcast`` shares every tensor of a batch with the members (views, the rest
    as it is); ``fusion.per_member_loss`` takes a target that is a dict of ``[B, ...]``
    tensors, under vmap or, for a loss vmap cannot run, member by member."""
    torch.manual_seed(0)
    tokens, weights = torch.randint(0, 5, (6, 4)), torch.rand(6, 4)
    shared = fusion.broadcast({"labels": tokens, "weights": weights, "name": "x"}, 3)
    assert shared["labels"].shape == (3, 6, 4) and shared["labels"].data_ptr() == tokens.data_ptr()
    assert shared["name"] == "x" and fusion.broadcast((tokens, weights), 3)[1].shape == (3, 6, 4)
    logits = torch.randn(3, 6, 4, 5, dtype=torch.float64)

    def weighted(out: torch.Tensor, target: dict[str, torch.Tensor]) -> torch.Tensor:
        per_token = F.cross_entropy(out.flatten(0, 1), target["labels"].flatten(), reduction="none")
        return (per_token * target["weights"].flatten()).sum() / target["weights"].sum()

    def weighted_item(out: torch.Tensor, target: dict[str, torch.Tensor]) -> torch.Tensor:
        return weighted(out, target) * (1.0 if target["weights"].sum().item() > 0 else 0.0)  # vmap cannot .item()

    for loss in (weighted, weighted_item):
        losses = fusion.per_member_loss(loss, logits, shared)
        for b in range(3):
            torch.testing.assert_close(losses[b], loss(logits[b], {"labels": tokens, "weights": weights}))
    with pytest.raises(fusion.FusionError, match="out has 3 members but target has 2"):
        fusion.per_member_loss(weighted, logits, fusion.broadcast({"labels": tokens, "weights": weights}, 2))


def test_a_validation_pass_takes_means_over_batches_or_the_whole_set() -> None:
    """A per-batch metric is its batches' values weighted by their samples and keeps no
    outputs; a metric over the whole set sees the batches' outputs and targets joined."""
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 10, 3), torch.randint(0, 3, (10,))
    mean_ce = Metric("loss", lambda o, t: float(F.cross_entropy(o, t)), "minimize", per_batch=True)
    whole = Metric("accuracy", accuracy)
    per_batch_only = Evaluation([mean_ce], 2)
    both = Evaluation([whole, mean_ce, Metric("n_params", lambda m: 0.0, of="model")], 2)
    for evaluation in (per_batch_only, both):
        evaluation.add(logits[:, :7], labels[:7])
        evaluation.add(logits[:, 7:], labels[7:])
    assert not per_batch_only.keep and per_batch_only.outs == [] and both.keep
    for b in range(2):
        expected = float(F.cross_entropy(logits[b], labels))
        assert per_batch_only.value(mean_ce, b) == pytest.approx(expected, rel=1e-6)
        assert both.value(whole, b) == accuracy(logits[b], labels)
    one = Evaluation([mean_ce], 1)
    one.add(logits[:1], labels)
    assert one.value(mean_ce, 0) == float(F.cross_entropy(logits[0], labels))  # one batch: its own value
