"""Workloads as torch users write them: every fused optimizer, LR schedules with warm-up,
gradient clipping, AMP and several metrics, through the worker's real training loop.

The reference is plain torch: the same model class, init seed, data order (the array's
permutation of each epoch) and torch's own optimizer, ``ChainedScheduler`` and
``clip_grad_norm_``. A one-member array, a member that joins a running array, and a member
preempted and resumed in another array must each end with torch's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fusetune.workers.actor import ArrayWorker
from fusetune.workers.checkpoints import load_checkpoint
from fusetune.workers.optimization import (
    LR_SCHEDULERS,
    OPTIMIZERS,
    ArrayOptimizer,
    OptionError,
    optimizer_arguments,
    resolve,
)
from fusetune.workers.signature import trial_signature
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec, TrainingSpec
from fusetune.workers.store import ArtifactStore
from fusetune.workers.training import Inbox, train_array
from fusetune.workers.workloads import get_workload

MLP = get_workload("digits-mlp")
SCHED = torch.optim.lr_scheduler


@pytest.fixture
def inbox() -> Iterator[ArrayWorker]:
    """A CPU worker's own inbox (offers and releases), without Ray; it sets torch's thread count."""
    threads = torch.get_num_threads()
    try:
        yield ArrayWorker("test-worker", "cpu", num_threads=threads)
    finally:
        torch.set_num_threads(threads)


def run(spec: ArraySpec, inbox: Inbox | None = None) -> tuple[list[EpochReport], ArrayOutcome]:
    """Drive ``train_array`` as the control plane does for a study without a pruner."""
    training = train_array(spec, torch.device("cpu"), inbox)
    reports = []
    try:
        reports.append(next(training))
        while True:
            reports.append(training.send(EpochReply()))
    except StopIteration as stop:
        return reports, stop.value


def spec_of(
    tmp_path: Path, members: Sequence[Mapping[str, Any]], *, epochs: int = 2, seed: int = 5, array_id: int = 1,
    training: TrainingSpec = TrainingSpec(), first_number: int = 0, workload: str = "digits-mlp",
) -> ArraySpec:
    return ArraySpec(
        array_id=array_id, signature="s", study_name="study", workload=workload, epochs=epochs,
        members=tuple(member(first_number + k, p) for k, p in enumerate(members)),
        seed=seed, artifact_dir=str(tmp_path), checkpoint_interval_s=0.0, training=training,
    )


def member(number: int, params: Mapping[str, Any]) -> MemberSpec:
    return MemberSpec(trial_id=100 + number, optuna_trial_id=1000 + number, number=number, params=dict(params))


def saved(tmp_path: Path, number: int) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / "study" / f"trial-{number}.pt", weights_only=True)


def permutations(seed: int, count: int) -> list[torch.Tensor]:
    """The data order of an array's first ``count`` epochs (``seed``: the spec's seed plus the
    array's first member's number)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randperm(1437, generator=generator) for _ in range(count)]


def torch_training(
    params: Mapping[str, Any],
    init_seed: int,
    orders: Sequence[torch.Tensor],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    max_norm: float | None = None,
    workload: Any = MLP,
    metrics: Sequence[float] | None = None,
) -> dict[str, torch.Tensor]:
    """One model trained by plain torch on the given epochs' data orders."""
    torch.manual_seed(init_seed)
    model = workload.build_model(params)
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    x, y = workload.datasets()[0].tensors
    for epoch, order in enumerate(orders):
        model.train()
        for begin in range(0, len(y), 64):
            idx = order[begin : begin + 64]
            loss = workload.loss(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
        if metrics is not None:
            scheduler.step(metrics[epoch])
        elif scheduler is not None:
            scheduler.step()
    return model.state_dict()


def assert_same_weights(fused: Mapping[str, torch.Tensor], plain: Mapping[str, torch.Tensor]) -> None:
    assert fused.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(fused[key], plain[key], rtol=1e-4, atol=1e-6, msg=key)


def warmup_then(epochs: int, scheduler: Callable[[torch.optim.Optimizer], Any]) -> Callable[[torch.optim.Optimizer], Any]:
    """torch's own spelling of fusetune's warm-up chained with a scheduler."""
    return lambda opt: SCHED.ChainedScheduler(
        [SCHED.LinearLR(opt, start_factor=1 / (epochs + 1), total_iters=epochs), scheduler(opt)]
    )


# Per optimizer: trial params as torch names them (numeric, per member), study kwargs (its flags).
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "SGD": ({"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-3}, {}),
    "Adam": ({"lr": 2e-3, "beta1": 0.8, "eps": 1e-7, "weight_decay": 1e-4}, {"amsgrad": True}),
    "AdamW": ({"lr": 2e-3, "betas": [0.85, 0.99], "weight_decay": 0.05}, {}),
    "RMSprop": ({"lr": 1e-3, "alpha": 0.9, "momentum": 0.5}, {"centered": True}),
    "Adagrad": ({"lr": 0.05, "lr_decay": 1e-3, "initial_accumulator_value": 0.1}, {}),
    "Adadelta": ({"lr": 1.0, "rho": 0.8, "eps": 1e-5}, {"maximize": False}),
}


def test_every_fused_optimizer_is_covered() -> None:
    assert set(CASES) == set(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_fused_optimizer_trains_a_member_as_torch_does(tmp_path: Path, name: str) -> None:
    hparams, flags = CASES[name]
    params = {"hidden": 16, "optimizer": name.lower(), **hparams, "gamma": 0.5, "warmup_epochs": 1, "max_norm": 0.5}
    training = TrainingSpec(lr_scheduler="StepLR", lr_scheduler_kwargs={"step_size": 1}, optimizer=name, optimizer_kwargs=flags)
    reports, outcome = run(spec_of(tmp_path, [params], epochs=3, training=training))
    assert outcome.error is None and outcome.completed == [100]

    torch_kwargs = {k: v for k, v in hparams.items() if k not in ("beta1", "beta2")} | flags
    if "beta1" in hparams:
        torch_kwargs["betas"] = (hparams["beta1"], 0.999)
    plain = torch_training(
        params, 5, permutations(5, 3),
        lambda p: getattr(torch.optim, name)(p, **torch_kwargs),
        warmup_then(1, lambda opt: SCHED.StepLR(opt, step_size=1, gamma=0.5)),
        max_norm=0.5,
    )
    assert_same_weights(saved(tmp_path, 0), plain)
    # Every argument the trial named reached the optimizer (its names come from its signature).
    recipe = resolve(MLP, training, params)
    assert set(torch_kwargs) <= set(recipe.hparams) | set(recipe.options) <= set(optimizer_arguments(name))


def test_a_member_that_joins_gets_its_own_warm_up_schedule_and_clipping(tmp_path: Path, inbox: ArrayWorker) -> None:
    """A (no warm-up) trains from epoch 0; B joins at the first boundary with a warm-up, which
    the array then starts for it alone, and its own schedule and clipping limit."""
    a = {"hidden": 16, "lr": 0.05, "momentum": 0.9, "gamma": 0.5}
    b = {"hidden": 16, "lr": 0.1, "momentum": 0.5, "gamma": 0.7, "warmup_epochs": 1, "max_norm": 0.5}
    training = TrainingSpec(lr_scheduler="StepLR", lr_scheduler_kwargs={"step_size": 1})
    spec = spec_of(tmp_path, [a], epochs=2, training=training)
    inbox.offer(spec.array_id, [member(1, b)])
    reports, outcome = run(spec, inbox)
    assert sorted(outcome.completed) == [100, 101] and len(reports) == 3
    orders = permutations(5, 3)
    plain_a = torch_training(a, 5, orders[:2], lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                             lambda opt: SCHED.StepLR(opt, step_size=1, gamma=0.5))
    plain_b = torch_training(b, 6, orders[1:], lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5),
                             warmup_then(1, lambda opt: SCHED.StepLR(opt, step_size=1, gamma=0.7)), max_norm=0.5)
    assert_same_weights(saved(tmp_path, 0), plain_a)
    assert_same_weights(saved(tmp_path, 1), plain_b)


def test_an_offer_for_a_later_boundary_waits_in_the_inbox_until_then(inbox: ArrayWorker) -> None:
    now, later = member(1, {}), member(2, {})
    inbox.offer(7, [now])
    inbox.offer(7, [later], after_epoch=3)
    assert inbox.take(7, 1) == [now]
    assert inbox.take(7, 2) == []
    assert inbox.take(7, 3) == [later]
    assert inbox.take(7, 4) == []


def test_a_successor_joins_at_the_boundary_where_the_last_member_leaves(tmp_path: Path, inbox: ArrayWorker) -> None:
    """An array of one goes on as a chain: the successor, offered ahead for the boundary after
    the member's last epoch, starts there, and the array never trains two at once."""
    a = {"hidden": 16, "lr": 0.05}
    b = {"hidden": 16, "lr": 0.1}
    spec = spec_of(tmp_path, [a], epochs=3)
    inbox.offer(spec.array_id, [member(1, b)], after_epoch=3)
    reports, outcome = run(spec, inbox)
    assert [r.size for r in reports] == [1] * 6
    assert [[m.trial_id for m in r.members] for r in reports] == [[100]] * 3 + [[101]] * 3
    assert [m.state for m in reports[2].members] == ["COMPLETE"] and [j.trial_id for j in reports[3].joined] == [101]
    assert outcome.completed == [100, 101]
    # The successor trained from scratch, as a fresh array of its own would have.
    plain_b = torch_training(b, spec.seed + 1, permutations(spec.seed, 6)[3:], lambda p: torch.optim.SGD(p, lr=0.1))
    assert_same_weights(saved(tmp_path, 1), plain_b)


def test_a_preempted_member_resumes_its_schedule_from_its_checkpoint(tmp_path: Path, inbox: ArrayWorker) -> None:
    params = {"hidden": 16, "lr": 3e-3, "warmup_epochs": 1, "eta_min": 1e-4}
    training = TrainingSpec(optimizer="Adam", lr_scheduler="CosineAnnealingLR", lr_scheduler_kwargs={"T_max": 3})
    first = spec_of(tmp_path, [params], epochs=3, seed=3, array_id=1, training=training)
    inbox.release(first.array_id, [100])
    _, outcome = run(first, inbox)
    assert outcome.released == [100] and outcome.epochs_done == 1
    checkpoint = load_checkpoint(ArtifactStore(tmp_path), "study/checkpoints/trial-0/1.pt")
    assert set(checkpoint["schedules"]) == {"warmup", "lr_scheduler"}

    reports, outcome = run(spec_of(tmp_path, [params], epochs=3, seed=4, array_id=2, training=training))
    assert outcome.completed == [100] and [r.members[0].step for r in reports] == [1, 2]
    orders = [permutations(3, 1)[0], *permutations(4, 2)]
    plain = torch_training(params, 3, orders, lambda p: torch.optim.Adam(p, lr=3e-3),
                           warmup_then(1, lambda opt: SCHED.CosineAnnealingLR(opt, T_max=3, eta_min=1e-4)))
    assert_same_weights(saved(tmp_path, 0), plain)


def test_reduce_lr_on_plateau_steps_on_the_members_first_objective(tmp_path: Path) -> None:
    # An absolute threshold of 1.0 on accuracy: no epoch after the first counts as better, so
    # with patience 0 the lr halves after every later epoch.
    params = {"hidden": 16, "lr": 0.1, "momentum": 0.9, "patience": 0, "factor": 0.5}
    kwargs = {"mode": "max", "threshold_mode": "abs", "threshold": 1.0}
    training = TrainingSpec(lr_scheduler="ReduceLROnPlateau", lr_scheduler_kwargs=kwargs)
    reports, outcome = run(spec_of(tmp_path, [params], epochs=3, training=training))
    assert outcome.error is None
    plain = torch_training(
        params, 5, permutations(5, 3), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda opt: SCHED.ReduceLROnPlateau(opt, patience=0, factor=0.5, **kwargs),
        metrics=[r.members[0].value for r in reports],
    )
    assert_same_weights(saved(tmp_path, 0), plain)
    unscheduled = torch_training(params, 5, permutations(5, 3), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert any(not torch.allclose(plain[k], unscheduled[k]) for k in plain)  # the schedule did change the lr


def test_members_with_different_optimizers_never_share_an_array(tmp_path: Path) -> None:
    spec = spec_of(tmp_path, [{"hidden": 16, "optimizer": "SGD"}, {"hidden": 16, "optimizer": "Adam"}])
    _, outcome = run(spec)
    assert outcome.error is not None and "OptionError" in outcome.error and "SGD" in outcome.error
    assert set(outcome.failed) == {100, 101} and outcome.completed == []


def test_the_optimizer_and_its_flags_are_in_the_shape_signature_its_numbers_are_not() -> None:
    base = {"hidden": 32, "lr": 0.1}
    sig = lambda **change: trial_signature(MLP, {**base, **change})  # noqa: E731
    assert sig() == sig(lr=0.01, momentum=0.5, max_norm=1.0, warmup_epochs=2)  # per member: fused together
    assert sig() == sig(optimizer="sgd")  # the workload's own, by its lower-case name
    assert len({sig(), sig(optimizer="Adam"), sig(optimizer="AdamW"), sig(optimizer="RMSprop")}) == 4
    assert sig() != sig(nesterov=True, momentum=0.9)
    assert sig(optimizer="Adam") != sig(optimizer="Adam", amsgrad=True)
    stepped = TrainingSpec(lr_scheduler="StepLR", lr_scheduler_kwargs={"step_size": 2})
    assert trial_signature(MLP, base, stepped) != sig()
    assert trial_signature(MLP, base, stepped) == trial_signature(MLP, {**base, "gamma": 0.3}, stepped)
    assert trial_signature(MLP, base, TrainingSpec(amp=True)) != sig()


def test_recipes_take_the_trials_value_else_the_studys_else_the_workloads_else_torchs() -> None:
    study = TrainingSpec(optimizer="SGD", optimizer_kwargs={"momentum": 0.8, "nesterov": True})
    recipe = resolve(MLP, study, {"lr": 0.3})
    assert recipe.optimizer == "SGD"
    assert recipe.hparams == {"lr": 0.3, "momentum": 0.8, "dampening": 0.0, "weight_decay": 0.0}
    assert recipe.options == {"nesterov": True, "maximize": False}
    assert resolve(MLP, study, {}).hparams["lr"] == 0.05  # the workload's default for its SGD
    # Another optimizer per trial: the study's and workload's SGD defaults are not its own.
    adam = resolve(MLP, study, {"optimizer": "adam", "beta2": 0.98})
    assert adam.optimizer == "Adam" and adam.hparams == {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "betas": (0.9, 0.98)}
    assert resolve(MLP, None, {"optimizer": "Adam", "betas": [0.5, 0.6], "beta1": 0.7}).hparams["betas"] == (0.7, 0.6)
    # Names come from the fused optimizer's signature: RMSprop's alpha, Adagrad's lr_decay.
    assert resolve(MLP, None, {"optimizer": "RMSprop", "alpha": 0.5}).hparams["alpha"] == 0.5
    assert resolve(MLP, None, {"optimizer": "Adagrad", "lr_decay": 0.1}).hparams["lr_decay"] == 0.1
    # eps is Adam's and ReduceLROnPlateau's: the optimizer's wins; the scheduler keeps its default.
    plateau = resolve(MLP, TrainingSpec(optimizer="Adam", lr_scheduler="ReduceLROnPlateau"), {"eps": 1e-6, "patience": 2})
    assert plateau.hparams["eps"] == 1e-6 and plateau.lr_scheduler_kwargs["eps"] == 1e-8
    assert plateau.lr_scheduler_kwargs["patience"] == 2


@pytest.mark.parametrize(
    ("training", "params", "param"),
    [
        (None, {"optimizer": "Adam", "betas": [0.9]}, "betas"),
        (None, {"optimizer": "Adam", "betas": [0.9, 0.99, 0.999]}, "betas"),
        (None, {"optimizer": "Adam", "betas": 0.9}, "betas"),
        (None, {"optimizer": "Adam", "beta1": 1.5}, "betas"),
        (None, {"optimizer": "Adamax"}, "optimizer"),
        (None, {"optimizer": "SGD", "lr": "fast"}, "lr"),
        (None, {"optimizer": "SGD", "lr": -0.1}, "lr"),
        (TrainingSpec(optimizer="SGD", optimizer_kwargs={"betas": (0.9, 0.9)}), {}, "betas"),
        (None, {"lr_scheduler": "StepLR"}, "step_size"),
        (None, {"lr_scheduler": "CosineAnnealing"}, "lr_scheduler"),
        (TrainingSpec(lr_scheduler="StepLR", lr_scheduler_kwargs={"step_size": 1, "gama": 0.1}), {}, "gama"),
        (None, {"warmup_epochs": -1}, "warmup_epochs"),
        (None, {"warmup_epochs": 1.5}, "warmup_epochs"),
        (None, {"max_norm": 0.0}, "max_norm"),
    ],
)
def test_bad_recipes_raise_naming_the_parameter(training: TrainingSpec | None, params: dict, param: str) -> None:
    with pytest.raises(OptionError) as error:
        resolve(MLP, training, params)
    assert error.value.param == param
    assert param in str(error.value)


def test_every_scheduler_a_request_can_name_builds_from_its_arguments() -> None:
    required = {
        "StepLR": {"step_size": 2}, "MultiStepLR": {"milestones": [1, 2]}, "CosineAnnealingLR": {"T_max": 4},
        "CosineAnnealingWarmRestarts": {"T_0": 2}, "CyclicLR": {"base_lr": 0.01, "max_lr": 0.1},
        "OneCycleLR": {"max_lr": 0.1, "total_steps": 4}, "ExponentialLR": {"gamma": 0.9},
    }
    import fusetune.fusion as fusion

    for name in LR_SCHEDULERS:
        training = TrainingSpec(lr_scheduler=name, lr_scheduler_kwargs=required.get(name, {}))
        recipes = [resolve(MLP, training, {"momentum": 0.9}), resolve(MLP, training, {"momentum": 0.8, "lr": 0.1})]
        optim = ArrayOptimizer(fusion.fuse([MLP.build_model({}), MLP.build_model({})]), recipes, torch.device("cpu"))
        optim.end_epoch([0.5, 0.5])
        assert type(optim.scheduler).__name__ == name


def test_a_completed_member_reports_every_objective_the_first_every_epoch(tmp_path: Path) -> None:
    training = TrainingSpec(metrics=("accuracy", "n_params"))
    reports, outcome = run(spec_of(tmp_path, [{"hidden": 16}, {"hidden": 16, "lr": 0.2}], epochs=2, training=training))
    assert all(m.values == () for m in reports[0].members)
    for report in reports[1].members:
        assert report.state == "COMPLETE"
        accuracy, size = report.values
        assert accuracy == report.value and 0.0 < accuracy <= 1.0
        assert size == (64 * 16 + 16) + (16 * 16 + 16) + (16 * 10 + 10)
    # A model metric first: every epoch's intermediate value is the model's size.
    reports, _ = run(spec_of(tmp_path, [{"hidden": 16}], epochs=2, training=TrainingSpec(metrics=("n_params",))))
    assert [r.members[0].value for r in reports] == [1482.0, 1482.0] and reports[-1].members[0].values == (1482.0,)


def test_amp_is_ignored_on_the_cpu(tmp_path: Path) -> None:
    """CPU workers train in float32 when a study asks for AMP: the same weights as without it."""
    params = {"hidden": 16, "lr": 0.05}
    run(spec_of(tmp_path / "amp", [params], epochs=1, training=TrainingSpec(amp=True)))
    run(spec_of(tmp_path / "plain", [params], epochs=1))
    assert_same_weights(saved(tmp_path / "amp", 0), saved(tmp_path / "plain", 0))
    recipe = resolve(MLP, TrainingSpec(amp=True), params)
    import fusetune.fusion as fusion

    optim = ArrayOptimizer(fusion.fuse([MLP.build_model(params)]), [recipe], torch.device("cpu"))
    assert recipe.amp and not optim.amp and optim.scaler is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="AMP runs only on CUDA devices; this machine has none")
def test_amp_on_cuda_trains_under_autocast_with_per_member_scales(tmp_path: Path) -> None:
    params = [{"hidden": 16, "lr": 0.05, "max_norm": 1.0}, {"hidden": 16, "lr": 0.1}]
    spec = spec_of(tmp_path, params, epochs=2, training=TrainingSpec(amp=True))
    training = train_array(spec, torch.device("cuda"))
    reports = [next(training)]
    with pytest.raises(StopIteration) as stop:
        reports.append(training.send(EpochReply()))
        training.send(EpochReply())
    outcome = stop.value.value
    assert outcome.error is None and sorted(outcome.completed) == [100, 101]
    assert all(0.5 < m.value <= 1.0 for m in reports[-1].members)  # float16 training still learns digits
    import fusetune.fusion as fusion

    optim = ArrayOptimizer(fusion.fuse([MLP.build_model(p) for p in params]).cuda(), [resolve(MLP, spec.training, p) for p in params], torch.device("cuda"))
    assert optim.amp and optim.scaler is not None and optim.autocast().fast_dtype == torch.float16
