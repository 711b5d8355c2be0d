"""Models fusion cannot fuse, through the worker's real training loop (``train_array``).

A model that fuses by neither path (its fused forward fails, vmap's and the per-member
loop's) is handed back untrained, its members not failed, with why (naming the module); an
array of one then trains it unfused, exactly as plain torch. A model that cannot train at
all still fails its trials; a module the fused model runs once per member is named in the
array's first report.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusetune.workers.actor import ArrayWorker
from fusetune.workers.optimization import resolve
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec
from fusetune.workers.training import train_array
from fusetune.workers.workloads import Workload, register_workload
from fusetune.workers.workloads._registry import _registered
from tests import people_workloads as people

SEED = 7


class HardestFour(nn.Module):
    """Adds to every sample the mean of the batch's four largest activations (hard-example
    mining inside the model): its dry run at batch sizes 2 and 3 cannot run, so no fused
    model of it can, even of one member."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(people.LENGTH * people.FEATURES, 16)
        self.head = nn.Linear(16, people.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x.flatten(1)))
        hardest = h.norm(dim=1).topk(4).indices
        return self.head(h + h[hardest].mean(0))


class Broken(nn.Module):
    """A model whose forward fails however it runs: it cannot train at all."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(people.LENGTH * people.FEATURES, people.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inp(x)  # not flattened: the shapes do not multiply


class RoundThrough(torch.autograd.Function):
    """Straight-through rounding whose backward passes gradients only while the input is in
    range (``.item()``): vmap runs its forward, and fails in its backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad if x.abs().max().item() < 1e4 else torch.zeros_like(grad)


class Quantized(nn.Module):
    """A learned scale on straight-through rounded activations."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(people.LENGTH * people.FEATURES, 16)
        self.scale = nn.Parameter(torch.ones(16))
        self.head = nn.Linear(16, people.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(RoundThrough.apply(F.relu(self.inp(x.flatten(1)))) * self.scale)


def _workload(name: str, model: type[nn.Module]) -> Workload:
    import dataclasses

    return dataclasses.replace(people.UNFUSIBLE, name=name, build_model=lambda params: model())


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    """The test workloads, in this process (train_array runs here)."""
    workloads = [
        people.POSITIONAL, people.PER_MEMBER, people.UNFUSIBLE,
        _workload("hardest-four", HardestFour), _workload("broken", Broken), _workload("quantized", Quantized),
    ]
    for workload in workloads:
        register_workload(workload)
    try:
        yield
    finally:
        for workload in workloads:
            _registered.pop(workload.name, None)


def spec(workload: str, members: int, tmp_path: Path, *, fused: bool = True, epochs: int = 2, resume: int = 0) -> ArraySpec:
    return ArraySpec(
        array_id=1, signature="s", study_name="study", workload=workload, epochs=epochs,
        members=tuple(MemberSpec(100 + n, n, n, {"lr": 0.01 * (n + 1)}, resume_epoch=resume) for n in range(members)),
        seed=SEED, artifact_dir=str(tmp_path), checkpoint_interval_s=0.0, fused=fused,
    )


def run(array: ArraySpec, inbox: ArrayWorker | None = None) -> tuple[list[EpochReport], ArrayOutcome]:
    """Drive ``train_array`` as the control plane does, every report recorded."""
    training = train_array(array, torch.device("cpu"), inbox)
    reports: list[EpochReport] = []
    try:
        reports.append(next(training))
        while True:
            reports.append(training.send(EpochReply()))
    except StopIteration as stop:
        return reports, stop.value


def test_a_model_that_fuses_by_neither_path_comes_back_untrained_naming_its_module(tmp_path: Path) -> None:
    """vmap cannot run the temperature (``.item()``) and the per-member loop cannot either (an
    in-place clamp of one member's view): no report, no trial failed, the reason names it."""
    reports, outcome = run(spec("temperature-mlp", 3, tmp_path))
    assert reports == [] and outcome.epochs_done == 0
    assert outcome.failed == {} and outcome.completed == [] and not outcome.oom
    assert outcome.unfusible is not None and outcome.unfusible.startswith("submodule 'out' (Temperature): RuntimeError")
    assert "modified inplace" in outcome.unfusible and ".item()" in outcome.unfusible  # the loop's, and vmap's before it
    assert outcome.error is not None and outcome.unfusible in outcome.error


def test_an_unfused_array_trains_its_member_as_plain_torch_does(tmp_path: Path) -> None:
    """An array of one with ``fused=False`` trains the model as written: the same weights as
    a plain torch loop over the same batches, with torch's own AdamW."""
    reports, outcome = run(spec("temperature-mlp", 1, tmp_path, fused=False, epochs=2))
    assert outcome.error is None and outcome.completed == [100] and [r.size for r in reports] == [1, 1]
    assert all(r.warnings == () for r in reports)

    workload, member = people.UNFUSIBLE, spec("temperature-mlp", 1, tmp_path).members[0]
    torch.default_generator.manual_seed(SEED + member.number)
    model = workload.build_model(member.params)
    optimizer = resolve(workload, None, member.params).torch_optimizer(model.parameters())
    train, _ = workload.datasets()
    x, y = train.tensors
    order = torch.Generator().manual_seed(SEED + member.number)
    for _ in range(2):
        permutation = torch.randperm(len(y), generator=order)
        for begin in range(0, len(y), workload.batch_size):
            idx = permutation[begin : begin + workload.batch_size]
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
    saved = torch.load(reports[-1].members[0].state_dict, weights_only=True)
    assert saved.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_an_unfused_member_is_checkpointed_and_resumes(tmp_path: Path) -> None:
    """Preempted after an epoch, the unfused member leaves with its checkpoint and resumes
    from it in the next array of one."""
    threads = torch.get_num_threads()
    inbox = ArrayWorker("test-worker", "cpu", num_threads=threads)
    try:
        first = spec("temperature-mlp", 1, tmp_path, fused=False, epochs=3)
        inbox.release(first.array_id, [100])
        reports, outcome = run(first, inbox)
        assert outcome.released == [100] and reports[0].members[0].step == 0
        reports, outcome = run(spec("temperature-mlp", 1, tmp_path, fused=False, epochs=3, resume=1))
    finally:
        torch.set_num_threads(threads)
    assert reports[0].joined[0].resumed_at_epoch == 1
    assert [r.members[0].step for r in reports] == [1, 2] and outcome.completed == [100]


def test_newcomers_that_make_a_fresh_fused_model_fusion_cannot_run_are_not_failed(tmp_path: Path) -> None:
    """A chain: the one member completes, two newcomers make a fresh fused model at that
    boundary, which fails its first step: the member's result stands, the newcomers come
    back untrained, not failed, with the reason."""
    threads = torch.get_num_threads()
    inbox = ArrayWorker("test-worker", "cpu", num_threads=threads)
    try:
        array = spec("temperature-mlp", 1, tmp_path, epochs=1)
        inbox.offer(array.array_id, [MemberSpec(200 + n, 10 + n, 10 + n, {"lr": 0.01}) for n in range(2)])
        reports, outcome = run(array, inbox)
    finally:
        torch.set_num_threads(threads)
    assert [r.size for r in reports] == [1] and outcome.completed == [100] and outcome.failed == {}
    assert outcome.unfusible is not None and outcome.unfusible.startswith("submodule 'out' (Temperature)")


def test_a_model_no_fused_model_can_run_even_alone_trains_unfused(tmp_path: Path) -> None:
    """Its dry run fails at any size, one member included: it comes back untrained, naming its
    root, and trains unfused."""
    reports, outcome = run(spec("hardest-four", 1, tmp_path))
    assert reports == [] and outcome.failed == {}
    assert outcome.unfusible is not None and outcome.unfusible.startswith("submodule '<root>' (HardestFour): FusionError: dry run")
    reports, outcome = run(spec("hardest-four", 1, tmp_path, fused=False))
    assert outcome.error is None and outcome.completed == [100] and len(reports) == 2


def test_a_model_whose_fused_backward_fails_trains_unfused(tmp_path: Path) -> None:
    """vmap runs the root's forward (so the per-member loop is never tried) and fails in the
    backward, at the first step: that is fusion's failure too."""
    reports, outcome = run(spec("quantized", 2, tmp_path))
    assert reports == [] and outcome.failed == {}
    assert outcome.unfusible is not None and outcome.unfusible.startswith("the model (Quantized), in RoundThrough.backward: ")
    assert ".item()" in outcome.unfusible
    reports, outcome = run(spec("quantized", 1, tmp_path, fused=False))
    assert outcome.error is None and outcome.completed == [100] and len(reports) == 2


def test_a_model_that_cannot_train_at_all_fails_its_trials(tmp_path: Path) -> None:
    """Its own model fails too: the members fail with the fused model's error, as before."""
    reports, outcome = run(spec("broken", 2, tmp_path))
    assert reports == [] and outcome.unfusible is None
    assert sorted(outcome.failed) == [100, 101] and all("mat1 and mat2" in e for e in outcome.failed.values())


def test_a_module_run_once_per_member_is_named_in_the_first_report(tmp_path: Path) -> None:
    reports, outcome = run(spec("gated-mlp", 2, tmp_path))
    assert outcome.error is None and outcome.completed == [100, 101] and [r.size for r in reports] == [2, 2]
    (warning,) = reports[0].warnings
    assert warning.startswith("submodule 'block' (Gate) runs once per member") and ".item()" in warning
    assert reports[1].warnings == ()


def test_a_learned_positional_parameter_fuses_on_the_batched_path(tmp_path: Path) -> None:
    reports, outcome = run(spec("positional-transformer", 3, tmp_path))
    assert outcome.error is None and outcome.unfusible is None and sorted(outcome.completed) == [100, 101, 102]
    assert [r.size for r in reports] == [3, 3] and all(r.warnings == () for r in reports)
