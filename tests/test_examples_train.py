"""The bring-your-own-model examples (docs/examples) train fused, as the service trains them.

Each example is a script a researcher runs against a service. Its ``WORKLOAD`` is imported
here from the file and packaged as ``create_study`` packages it (cloudpickled by value, its
search space stated as static distributions, no data read); the package's copy is trained by
the worker's real training loop (``train_array``), several trials as one fused array. Every
member ends with the weights and validation values of its model trained by a plain torch loop
over the same batches (the array's ``DataLoader`` is the one the ``Workload`` docstring
spells out: its batch size, its seed, the workload's loader options), and learns well above
chance.

The comparisons with plain torch run the examples in float64 (their models ``.double()``,
their images too). At the learning rates that learn within two epochs, SGD and AdamW on
these models amplify float32 rounding (the fused kernels add in another order than one
model's) about a thousandfold within an epoch: fused and plain members end ~1e-3 apart,
as two plain runs do whose initial weights differ by 1e-7. In float64 the amplified
rounding stays far below the tolerance. The examples as they are, in float32, are trained
fused too (with members that differ in their dropout, for the CNN).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle
import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset

from fusetune.client import package
from fusetune.server.packages import Limits, check_package
from fusetune.server.settings import Settings
from fusetune.workers.optimization import resolve
from fusetune.workers.signature import trial_signature
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec, TrainingSpec
from fusetune.workers.training import train_array
from fusetune.workers.workloads import Params, Workload, register_workload
from fusetune.workers.workloads._registry import _registered

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
SEED = 7


def load(name: str) -> ModuleType:
    """``docs/examples/<name>.py`` as a module of its own (not on sys.path: a user's script)."""
    spec = importlib.util.spec_from_file_location(f"fusetune_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CNN = load("residual_cnn")
LM = load("transformer_lm")


def packaged(workload: Workload) -> Workload:
    """The workload as the service receives it: the package's pickle, loaded."""
    made = package(workload)
    assert made.manifest["pickle"] is not None and made.workload_name == workload.name
    with zipfile.ZipFile(io.BytesIO(made.data)) as archive:
        loaded = cloudpickle.loads(archive.read(made.manifest["pickle"]))
    assert isinstance(loaded, Workload) and loaded.name == workload.name
    return loaded


class Float64(Dataset[Any]):
    """A dataset's samples with their floating-point tensors in float64 (its own
    ``__getitem__``, augmentation and all, runs first)."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return pytree.tree_map_only(torch.Tensor, lambda t: t.double() if t.is_floating_point() else t, self.dataset[index])


def in_float64(workload: Workload) -> Workload:
    """``workload`` with its models and data in float64."""

    def build_model(params: Params) -> nn.Module:
        return workload.build_model(params).double()

    def datasets() -> tuple[Dataset[Any], Dataset[Any]]:
        train, val = workload.datasets()
        return Float64(train), Float64(val)

    return dataclasses.replace(workload, build_model=build_model, datasets=datasets)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread, as the fusion tests run: the models are small, and on a machine
    shared with other jobs two spinning threads make these tests several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def registered() -> Iterator[list[Workload]]:
    """Workloads registered in this process (train_array runs here) for one test."""
    workloads: list[Workload] = []
    try:
        yield workloads
    finally:
        for workload in workloads:
            _registered.pop(workload.name, None)


def spec(workload: Workload, params: Sequence[Params], tmp_path: Path, epochs: int, metrics: tuple[str, ...]) -> ArraySpec:
    return ArraySpec(
        array_id=1, signature="s", study_name="study", workload=workload.name, epochs=epochs,
        members=tuple(MemberSpec(100 + n, n, n, dict(p)) for n, p in enumerate(params)),
        seed=SEED, artifact_dir=str(tmp_path), checkpoint_interval_s=0.0, training=TrainingSpec(metrics=metrics),
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


def assert_fused(reports: Sequence[EpochReport], outcome: ArrayOutcome, members: int, epochs: int) -> None:
    """Every member completed in the one fused array: not refused by fusion (which would have
    them train unfused, one per array), no module run once per member."""
    assert outcome.error is None and outcome.unfusible is None, outcome.error
    assert sorted(outcome.completed) == [100 + n for n in range(members)]
    assert [r.size for r in reports] == [members] * epochs
    assert [w for r in reports for w in r.warnings] == []


def train_plain(workload: Workload, array: ArraySpec) -> list[nn.Module]:
    """Each member's plain model, initialised as the worker initialises it (the study's seed
    plus its number, in member order: with ``num_workers`` 0 the augmentation then draws from
    the global RNG where the worker's does) and trained with torch's own optimizer of its
    recipe, one model after another on each batch of the array's loader twin."""
    models, optimizers = [], []
    for member in array.members:
        torch.manual_seed(array.seed + member.number)
        model = workload.build_model(member.params)
        models.append(model)
        optimizers.append(resolve(workload, None, member.params).torch_optimizer(model.parameters()))
    train, _ = workload.datasets()
    loader = DataLoader(train, batch_size=workload.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(array.seed), **workload.loader)
    for _ in range(array.epochs):
        for batch in loader:
            for model, optimizer in zip(models, optimizers):
                model.train()
                optimizer.zero_grad()
                workload.loss(workload.forward(model, batch), workload.target_of(batch)).backward()
                optimizer.step()
    return models


def assert_members_are(tmp_path: Path, array: ArraySpec, models: Sequence[nn.Module]) -> None:
    """Every member's saved weights (BatchNorm statistics included) are its plain model's."""
    for member, model in zip(array.members, models, strict=True):
        saved = torch.load(tmp_path / "study" / f"trial-{member.number}.pt", weights_only=True)
        assert saved.keys() == model.state_dict().keys()
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(saved[name], tensor, rtol=1e-7, atol=1e-9, msg=f"member {member.number}: {name}")


def by_epoch(reports: Sequence[EpochReport]) -> dict[int, list[float]]:
    """Each member's first objective after each epoch, by trial id."""
    out: dict[int, list[float]] = {}
    for report in reports:
        for r in report.members:
            out.setdefault(r.trial_id, []).append(r.value)
    return out


def finals(reports: Sequence[EpochReport]) -> dict[int, tuple[float, ...]]:
    """Each completed member's objectives, by trial id."""
    return {r.trial_id: r.values for report in reports for r in report.members if r.state == "COMPLETE"}


def test_the_examples_package_without_reading_their_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building and packaging a ``WORKLOAD`` generates no data (``datasets()`` runs on the
    workers); its search space is static, so ``create_study`` takes it as it is, and the
    service's upload check accepts the package."""

    def refuse(*args: Any) -> None:
        raise AssertionError("the data was generated while packaging")

    monkeypatch.setattr(CNN, "stripes", refuse)
    monkeypatch.setattr(LM, "motifs", refuse)
    cnn, lm = package(CNN.WORKLOAD), package(LM.WORKLOAD)
    for made in (cnn, lm):
        assert check_package(made.data, made.digest, Limits.of(Settings())).manifest.workload.name == made.workload_name
    assert sorted(cnn.manifest["search_space"]) == ["dropout", "lr", "momentum", "weight_decay", "width"]
    assert sorted(lm.manifest["search_space"]) == ["beta1", "d_model", "lr", "weight_decay"]
    assert [m["name"] for m in lm.manifest["workload"]["metrics"]] == ["token_accuracy", "token_loss"]


CNN_MEMBERS = (
    {"lr": 0.1, "momentum": 0.8, "weight_decay": 5e-4, "dropout": 0.0, "width": 8},
    {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4, "dropout": 0.0, "width": 8},
)


def test_the_residual_cnn_trains_fused_as_plain_torch_does(tmp_path: Path, registered: list[Workload]) -> None:
    """Two trials of the residual CNN (in float64) as one fused array, its images augmented in
    the training process: after an epoch their weights and BatchNorm statistics are their plain
    models', their accuracy over the whole validation set and their per-batch loss are, and
    they are well above chance (10 classes)."""
    workload = register_workload(in_float64(packaged(CNN.WORKLOAD)))
    registered.append(workload)
    assert len({trial_signature(workload, p) for p in CNN_MEMBERS}) == 1  # the service packs them together
    array = spec(workload, CNN_MEMBERS, tmp_path, epochs=1, metrics=("accuracy", "val_loss"))
    reports, outcome = run(array)
    assert_fused(reports, outcome, members=2, epochs=1)

    models = train_plain(in_float64(CNN.WORKLOAD), array)
    assert_members_are(tmp_path, array, models)

    _, val = CNN.WORKLOAD.datasets()
    values = finals(reports)
    for k, model in enumerate(models):
        with torch.no_grad():
            logits = model.eval()(val.images.double())
        accuracy, loss = values[100 + k]
        assert accuracy == pytest.approx(CNN.accuracy(logits, val.labels), abs=1e-6)  # a float32 mean
        assert loss == pytest.approx(CNN.mean_loss(logits, val.labels), rel=1e-9)
    assert min(v[0] for v in values.values()) > 0.2 and max(v[0] for v in values.values()) > 0.5, values


def test_the_residual_cnn_as_it_is_trains_trials_of_any_dropout_in_one_array(tmp_path: Path, registered: list[Workload]) -> None:
    """The example as it is (float32), two epochs: Dropout's ``p`` is a per-member setting of
    the fused Dropout, so trials that differ in it have one signature and train together
    (their masks are drawn as one: plain torch's in distribution, not sample by sample), and
    learn; another width is another array."""
    workload = register_workload(packaged(CNN.WORKLOAD))
    registered.append(workload)
    members = [dict(CNN_MEMBERS[0], dropout=p) for p in (0.0, 0.2, 0.4)]
    assert len({trial_signature(workload, p) for p in members}) == 1
    assert trial_signature(workload, dict(members[0], width=16)) != trial_signature(workload, members[0])
    reports, outcome = run(spec(workload, members, tmp_path, epochs=2, metrics=("accuracy",)))
    assert_fused(reports, outcome, members=3, epochs=2)
    curves = by_epoch(reports)  # from chance (0.1) to far above, the members' mean rising
    assert all(curve[-1] > 0.3 for curve in curves.values()), curves
    assert sum(c[1] for c in curves.values()) > sum(c[0] for c in curves.values()), curves


LM_MEMBERS = (
    {"lr": 1e-2, "weight_decay": 0.1, "beta1": 0.85, "d_model": 32},
    {"lr": 3e-3, "weight_decay": 0.01, "beta1": 0.9, "d_model": 32},
)


def test_the_transformer_lm_trains_fused_as_plain_torch_does(tmp_path: Path, registered: list[Workload]) -> None:
    """Two trials of the Transformer LM (in float64; the learned position table on the model's
    root, which runs under vmap, the encoder's layers fused, under the causal mask) on dict
    batches, with AdamW: after an epoch their weights are their plain models', their
    per-batch token accuracy and loss are the whole validation set's, and they predict far
    more tokens than chance (1/16)."""
    workload = register_workload(in_float64(packaged(LM.WORKLOAD)))
    registered.append(workload)
    assert len({trial_signature(workload, p) for p in LM_MEMBERS}) == 1
    array = spec(workload, LM_MEMBERS, tmp_path, epochs=1, metrics=("token_accuracy", "token_loss"))
    reports, outcome = run(array)
    assert_fused(reports, outcome, members=2, epochs=1)

    models = train_plain(in_float64(LM.WORKLOAD), array)
    assert_members_are(tmp_path, array, models)

    _, val = LM.WORKLOAD.datasets()
    values = finals(reports)
    for k, model in enumerate(models):
        with torch.no_grad():
            logits = model.eval()(val.tokens)
        token_accuracy, token_loss = values[100 + k]
        # Sequences of one length: the batches' means weighted by their sequences are the set's.
        assert token_accuracy == pytest.approx(LM.token_accuracy(logits, val.tokens), abs=1e-6)  # a float32 mean
        assert token_loss == pytest.approx(LM.token_loss(logits, val.tokens), rel=1e-9)
    assert min(v[0] for v in values.values()) > 0.3, values


def test_the_transformer_lm_as_it_is_trains_fused(tmp_path: Path, registered: list[Workload]) -> None:
    """The example as it is (float32), two epochs: fused, every member rising far above chance."""
    workload = register_workload(packaged(LM.WORKLOAD))
    registered.append(workload)
    reports, outcome = run(spec(workload, LM_MEMBERS, tmp_path, epochs=2, metrics=("token_accuracy",)))
    assert_fused(reports, outcome, members=2, epochs=2)
    curves = by_epoch(reports)
    assert all(curve[1] > curve[0] > 0.3 for curve in curves.values()) and max(c[1] for c in curves.values()) > 0.5, curves
