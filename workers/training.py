"""Training one array: B trials of a workload as one fused model, reporting every epoch."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import torch
from torch import nn

import fusetune.fusion as fusion
from fusetune.workers.checkpoints import CheckpointWriter, UnreadableCheckpoint, checkpoint_dir, load_checkpoint, saved_epochs
from fusetune.workers.data import ArrayData
from fusetune.workers.evaluation import Evaluation, number
from fusetune.workers.optimization import ArrayOptimizer, Recipe, optimizer_kwargs, resolve
from fusetune.workers.package import PackageError, workload_of
from fusetune.workers.spec import (
    ArrayOutcome,
    ArraySpec,
    EpochReply,
    EpochReport,
    Joined,
    MemberReport,
    MemberSpec,
    TrainingSpec,
)
from fusetune.workers.store import ArtifactStore, get_store
from fusetune.workers.unfused import NotFused, Unfused, where_it_failed
from fusetune.workers.workloads import Batch, Metric, Workload

log = logging.getLogger(__name__)

#: What an array trains: its members fused, or one member unfused (a class that fuses by neither path).
ArrayModel = fusion.FusedModel | Unfused

__all__ = ["ArrayRun", "build_models", "objectives", "optimizer_kwargs", "probe_solo_speed", "recipes", "train_array"]


def recipes(workload: Workload, training: TrainingSpec, members: Sequence[MemberSpec]) -> list[Recipe]:
    """How each member trains (``workers.optimization.resolve``)."""
    return [resolve(workload, training, m.params) for m in members]


def objectives(workload: Workload, training: TrainingSpec) -> list[Metric]:
    """The study's objectives, in order: the first is every epoch's intermediate value."""
    return [workload.metric_named(name) for name in training.metrics] or [workload.metric_named(workload.metric_name)]

def build_models(workload: Workload, members: Sequence[MemberSpec], seed: int) -> list[nn.Module]:
    """One model per member, each initialised from ``seed`` + its trial number: the same trial
    of a study starts from the same weights in whichever array it trains."""
    models = []
    for member in members:
        # The CPU generator alone (models are built on the CPU): torch.manual_seed also queues
        # a lazy CUDA seeding with its stack trace, ~1 ms a member, a third of an array's build.
        torch.default_generator.manual_seed(seed + member.number)
        models.append(workload.build_model(member.params))
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # dropout on the device draws from its own generator
    return models


def save_member(fused: ArrayModel, index: int, spec: ArraySpec, member: MemberSpec) -> str:
    """Save member ``index`` as a plain state_dict of the workload's model class in the
    artifact store; returns where (a local path, or the store's URI of it)."""
    state = {k: v.detach().cpu() for k, v in fused.member_state_dict(index).items()}
    return get_store(spec.artifact_dir).save_torch(f"{spec.study_name}/trial-{member.number}.pt", state)


def _checkpoint_of(spec: ArraySpec, member: MemberSpec) -> str | None:
    """The store folder of the member's checkpoints (None: the array keeps none)."""
    return checkpoint_dir(spec.study_name, member.number) if spec.artifact_dir else None


def _folder(spec: ArraySpec, member: MemberSpec) -> str:
    """The store folder of the member's checkpoints, in an array that keeps them."""
    return checkpoint_dir(spec.study_name, member.number)


def resume_members(
    spec: ArraySpec, members: Sequence[MemberSpec], models: Sequence[nn.Module]
) -> tuple[list[int], list[tuple[dict[str, Any], dict[str, Any]] | None]]:
    """Load the checkpointed weights of the members that resume into ``models``.

    A member resumes from the checkpoint its ``resume_epoch`` names (the one the control
    plane recorded), or, when that is None, from its newest one in the store; 0 starts it
    from scratch. A member whose checkpoint cannot be read (truncated, corrupt, missing)
    resumes from its newest older one that can, else from scratch: that member alone, the
    array trains on. Returns each member's epochs done (0 when starting fresh) and its
    (optimizer, schedules) states to load once the array's optimizer exists (None when fresh).
    """
    epochs: list[int] = []
    states: list[tuple[dict[str, Any], dict[str, Any]] | None] = []
    for member, model in zip(members, models, strict=True):
        folder = _checkpoint_of(spec, member)
        found = None
        if folder is not None and member.resume_epoch != 0:
            found = _restore(get_store(spec.artifact_dir), folder, member, model)
        if found is None:
            epochs.append(0)
            states.append(None)
            continue
        epochs.append(found[0])
        states.append(found[1])
    return epochs, states


def _restore(
    store: ArtifactStore, folder: str, member: MemberSpec, model: nn.Module
) -> tuple[int, tuple[dict[str, Any], dict[str, Any]]] | None:
    """Load into ``model`` the newest usable checkpoint of ``member`` at or before the one it
    resumes from; its epochs done and (optimizer, schedules) states, or None: none is usable."""
    for at in _fallbacks(store, folder, member.resume_epoch):
        try:
            checkpoint = load_checkpoint(store, f"{folder}/{at}.pt")
            if checkpoint is None:
                raise UnreadableCheckpoint("it is missing")
            _check_fits(checkpoint, at, model)
        except UnreadableCheckpoint as exc:
            log.warning("trial %d's checkpoint at epoch %d in %s cannot be used (%s)", member.number, at, folder, exc)
            continue
        model.load_state_dict(checkpoint["model"], strict=True)
        return at, (checkpoint["optimizer"], checkpoint.get("schedules") or {})
    return None


def _fallbacks(store: ArtifactStore, folder: str, wanted: int | None) -> Iterator[int]:
    """The epochs to try a member's checkpoints at, in order: ``wanted`` (the recorded one),
    then the store's checkpoints older than it (every one when None), newest first."""
    if wanted is not None:
        yield wanted
    # Listed only when the recorded one failed: a listing is a round trip on an object store.
    yield from sorted((e for e in saved_epochs(store, folder) if wanted is None or e < wanted), reverse=True)


def _check_fits(checkpoint: dict[str, Any], at: int, model: nn.Module) -> None:
    """Raises UnreadableCheckpoint unless ``checkpoint`` is the one after ``at`` epochs and
    holds exactly ``model``'s tensors, shapes included: loading it can then not fail half way."""
    if checkpoint["epochs_done"] != at:
        raise UnreadableCheckpoint(f"it says {checkpoint['epochs_done']} epochs done, its name {at}")
    expected, saved = model.state_dict(), checkpoint["model"]
    if set(saved) != set(expected) or any(
        isinstance(v, torch.Tensor) and (not isinstance(saved[k], torch.Tensor) or saved[k].shape != v.shape)
        for k, v in expected.items()
    ):
        raise UnreadableCheckpoint("its weights are not this member's model's (names or shapes differ)")


def _joined(
    members: Sequence[MemberSpec], epochs: Sequence[int], states: Sequence[Any]
) -> list[Joined]:
    """What a report says of members that just started: the epoch each really resumed at.

    A member that was to resume from a checkpoint and restarts from scratch (none of its
    checkpoints could be read) says 0, so the control plane drops its stored values from
    step 0 on, as it drops them from an older checkpoint's epoch for a member that fell back.
    """
    return [
        Joined(m.trial_id, e if s is not None else (0 if m.resume_epoch else None))
        for m, e, s in zip(members, epochs, states, strict=True)
    ]


def _resumed(
    writer: CheckpointWriter, spec: ArraySpec, members: Sequence[MemberSpec], epochs: Sequence[int], states: Sequence[Any]
) -> None:
    """The checkpoints members resumed from are in the store already: reports may name them.
    Newer ones of theirs (a dead array's, trained past what the control plane recorded, or
    unreadable) go; of the older ones the newest stays, the fallback of the next resume.
    A member that starts from scratch has none left."""
    if spec.artifact_dir is None:
        return
    for member, done, state in zip(members, epochs, states, strict=True):
        if state is not None:
            writer.assume(_folder(spec, member), done)
            writer.confirm(_folder(spec, member), done, newer=True)
        elif member.resume_epoch is not None:
            writer.remove(_folder(spec, member))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the device ran out of memory (CUDA's OOM, or the CPU allocator's)."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def _load_states(optim: ArrayOptimizer, first: int, states: Sequence[tuple[dict[str, Any], dict[str, Any]] | None]) -> None:
    for k, state in enumerate(states):
        if state is not None:
            optim.load_member_state(first + k, *state)


def probe_solo_speed(
    workload: Workload,
    member: MemberSpec,
    batches: Iterator[Batch],
    device: torch.device,
    steps: int,
    warmup: int = 3,
    training: TrainingSpec | None = None,
) -> float:
    """Steps/s of one member's model trained alone, unfused, on the array's own data.

    It is the B = 1 point of the class's speed-up curve: with the array's own measured
    speed it tells the scheduler what fusing gains on this device, instead of the dry runs
    that used to delay a class's first array. A copy trains (from the member's init seed,
    one epoch's worth of steps at most) with torch's own optimizer, clipping and AMP as the
    member's recipe says, so the member itself is untouched. ``batches`` are training
    batches on ``device`` (``workers.data.Source.endless``): drawn at random from a
    ``TensorDataset``, or read through a loader of the probe's own, so a workload's data
    loading counts in the solo speed as it counts in the array's.
    """
    recipe = resolve(workload, training, member.params)
    torch.manual_seed(member.number)
    model = workload.build_model(member.params).to(device)
    optimizer = recipe.torch_optimizer(model.parameters())
    amp = recipe.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if amp else None
    model.train()
    clock = 0.0
    for k in range(warmup + steps):
        if k == warmup:
            _sync(device)
            clock = time.perf_counter()
        batch = next(batches)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = workload.loss(workload.forward(model, batch), workload.target_of(batch))
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if recipe.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    _sync(device)
    return steps / (time.perf_counter() - clock)


def _measure(metric: Metric, fused: ArrayModel, b: int, evaluation: Evaluation) -> float:
    """Member ``b``'s value of ``metric``: from the fused validation pass, or of its model."""
    with torch.no_grad():
        if metric.of == "model":
            return number(metric, metric.fn(fused.member(b)))
        return evaluation.value(metric, b)


def _said(error: BaseException) -> str:
    """An error's type and first line."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Inbox(Protocol):
    """Where newcomers for a running array wait for its next epoch boundary, and members the
    scheduler preempts are named; told when the array is set up and its first epoch starts,
    and asked, once its last epoch is reported, for the acknowledgements still owed to it."""

    def take(self, array_id: int, epochs_done: int = 0) -> list[MemberSpec]: ...

    def released(self, array_id: int) -> set[int]: ...

    def built(self, array_id: int) -> None: ...

    def acknowledged(self, array_id: int, owed: int, timeout_s: float) -> int: ...


class _Sent(NamedTuple):
    """A report the control plane has not acknowledged yet: what goes once it has."""

    checkpoints: list[tuple[str, int]]  # (folder, epochs done) of the checkpoints it named: older ones can go
    ended: list[str]  # the folders of the members that completed or failed in it: all their checkpoints can go


#: What ``train_array`` yields, is sent back, and returns (see its docstring).
Training = Generator[EpochReport, EpochReply | None, ArrayOutcome]


def train_array(spec: ArraySpec, device: torch.device, inbox: Inbox | None = None) -> Training:
    """Train ``spec``'s members as one fused model, each for ``spec.epochs`` epochs.

    A generator: after every epoch it yields one :class:`EpochReport` (every member's first
    objective, all of them for members that completed, the members that ended or left, the
    epoch's throughput and timings)
    and waits for the control plane's :class:`EpochReply` to be sent back (``send``), whose
    ``prune`` names the members the study's pruner stops. It returns the
    :class:`ArrayOutcome` (``StopIteration.value``).

    Members end on their own: after their last epoch (their weights saved as a plain
    state_dict first), when pruned, or when their loss stops being finite; the rest keep
    training, and the ended ones leave the fused model. Newcomers waiting in ``inbox`` join
    at the epoch boundary with fresh weights and optimizer state, so members of one array
    can be at different epochs. With an ``artifact_dir``, every member that trains on is
    checkpointed every ``spec.checkpoint_frequency`` epochs, in the background
    (``workers.checkpoints.CheckpointWriter``), and a member that has a checkpoint (its last
    worker died, or it was preempted) resumes from it: weights, optimizer state and epoch
    count (the data order of its later epochs differs). Each member trains with its own
    recipe (``workers.optimization``: optimizer, LR schedule and warm-up stepped once per
    epoch after validation, gradient clipping, AMP on CUDA). Members the scheduler preempts
    (``inbox.released``) leave at the next epoch boundary with a checkpoint written before
    the report says they left. Any other error fails the whole array, with the error recorded.

    Fusion's own failures fail no trial. Modules the fused model runs once per member (vmap
    cannot run them) are named in the report's ``warnings``. Where the fused model cannot
    be built, or fails its first training step or evaluation, and the first member's plain
    model trains, the model fuses by neither path: the array ends with the reason in
    ``ArrayOutcome.unfusible``, its members untrained and not failed, and the control plane
    trains them unfused (``spec.fused`` False: an array of one, :class:`workers.unfused.Unfused`).
    """
    run = ArrayRun(spec, device, inbox)
    try:
        run.build()
        if inbox is not None:
            inbox.built(spec.array_id)
        while run.members:
            report = run.epoch()
            clock = time.perf_counter()
            reply = (yield report) or EpochReply()
            run.timings["report_s"] += time.perf_counter() - clock
            run.boundary(reply)
        run.finish()
    except NotFused as exc:
        run.not_fused(exc.error)
    except Exception as exc:  # the array fails as a whole; every member still training records why
        run.fail(exc)
    finally:
        run.close()
    return run.outcome


_T = TypeVar("_T")
#: Frames of a failed array's traceback kept in each member's error: the innermost, where the
#: tenant's code (its loss, metric or model) raised; the outermost are always the worker's own.
_TRACEBACK_FRAMES = 8


def _optimizer(model: ArrayModel, members: Sequence[Recipe], device: torch.device) -> ArrayOptimizer:
    """The array's optimizer over its model's parameters (an unfused model's have a member axis too)."""
    return ArrayOptimizer(cast(fusion.FusedModel, model), members, device)  # it takes only model.parameters()


class ArrayRun:
    """One array as :func:`train_array` trains it: what it holds from one epoch boundary to
    the next (its data, fused model, optimizer, members and their epochs, checkpoints), and
    one method per phase of an epoch."""

    workload: Workload
    data: ArrayData
    metrics: list[Metric]
    fused: ArrayModel
    optim: ArrayOptimizer
    batch_size: int
    generator: torch.Generator
    fusing: MemberSpec  # the first member of the fused model being built or on trial

    def __init__(self, spec: ArraySpec, device: torch.device, inbox: Inbox | None) -> None:
        self.spec, self.device, self.inbox = spec, device, inbox
        self.outcome = ArrayOutcome(array_id=spec.array_id)
        self.timings: defaultdict[str, float] = defaultdict(float)  # seconds by phase, whole array
        self.members: list[MemberSpec] = list(spec.members)
        self.epochs_done: list[int] = []  # each member's, resumed epochs included
        self.joined: list[Joined] = []  # members that started since the last report
        self.writer = CheckpointWriter(get_store(spec.artifact_dir) if spec.artifact_dir else None)
        self.last_saved: dict[int, tuple[int, float]] = {}  # trial id -> (epochs done, train seconds) at its last checkpoint
        self.sent: deque[_Sent] = deque()  # the reports not acknowledged yet, oldest first
        self.member_steps, self.steps, self.train_seconds = 0, 0, 0.0
        self.built = 0.0  # the build's seconds, in the first epoch's report
        self.unproven: set[bool] = set()  # training flags the fused model has not run in yet
        self.warned: set[str] = set()  # warnings reported already
        # The epoch between two boundaries: its timings, its members, those that end or leave.
        self.epoch_s: defaultdict[str, float] = defaultdict(float)
        self.count = 0
        self.ended: dict[int, str] = {}  # member index -> how it ended at this boundary
        self.leaving: list[int] = []  # member indices preempted at this boundary

    # -- building ----------------------------------------------------------------------------------
    def build(self) -> None:
        """The data on the device, the members' models (resumed from their checkpoints), the
        fused model and its optimizer."""
        clock = time.perf_counter()
        spec, members = self.spec, self.members
        self.workload = workload = workload_of(spec.workload, spec.package)
        self.batch_size = workload.batch_size_for(members[0].params)
        # The data order is the array's members' (the first's number), not the array id's,
        # which depends on how the database numbered earlier arrays.
        seed = spec.seed + min(m.number for m in members)
        self.generator = torch.Generator().manual_seed(seed)
        self.data = ArrayData(workload, spec.training, self.device, self.batch_size, self.generator, seed)
        self.metrics = objectives(workload, spec.training)
        models = build_models(workload, members, spec.seed)
        self.epochs_done, states = resume_members(spec, members, models)
        _resumed(self.writer, spec, members, self.epochs_done, states)
        self.fused = self._fuse(models, members)
        self.optim = _optimizer(self.fused, recipes(workload, spec.training, members), self.device)
        _load_states(self.optim, 0, states)
        self.joined = _joined(members, self.epochs_done, states)
        # In the first epoch's report: the control plane weighs moving members by it.
        self.built = time.perf_counter() - clock

    def _fuse(self, models: list[nn.Module], members: list[MemberSpec]) -> ArrayModel:
        """``members``' models as one fused model on the device, or, for a class that fuses
        by neither path, the one member's own model (:class:`Unfused`). A fused model is on
        trial until it has run a training step and an evaluation (:meth:`_proving`)."""
        self.fusing = members[0]  # whose own model tells whether fusion is at fault (not_fused)
        if not self.spec.fused:
            if len(models) != 1:
                raise ValueError(f"an unfused array trains one member, not {len(models)}")
            self.unproven = set()
            return Unfused(models[0].to(self.device))
        try:
            fused = fusion.fuse(models).to(self.device)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise
            raise NotFused(exc) from exc
        self.unproven = {True, False}
        return fused

    def _proving(self, training: bool, call: Callable[[], _T]) -> _T:
        """``call()``, a call of the fused model in train (``training``) or eval mode. On its
        first call in that mode, what it raises may be fusion's failure: :class:`NotFused`."""
        if training not in self.unproven:
            return call()
        try:
            out = call()
        except Exception as exc:
            if is_out_of_memory(exc):
                raise
            raise NotFused(exc) from exc
        self.unproven.discard(training)
        return out

    # -- an epoch ----------------------------------------------------------------------------------
    def epoch(self) -> EpochReport:
        """Train and evaluate one epoch; end, save and release members; the epoch's report."""
        self.epoch_s = defaultdict(float)
        self.epoch_s["build_s"], self.built = self.built, 0.0
        self.count = len(self.members)
        final_losses, epoch_steps = self._train()
        solo = self._probe(epoch_steps)
        values, evaluation = self._evaluate()
        self.outcome.epochs_done += 1
        reports = self._end_members(final_losses, values, evaluation)
        self._release()
        return self._report(reports, epoch_steps, solo)

    def _train(self) -> tuple[list[float], int]:
        """One pass over the training data: each member's last loss, and the steps taken."""
        self.fused.train()
        clock = time.perf_counter()
        losses = torch.zeros(self.count, device=self.device)
        epoch_steps = 0
        for batch in self.data.epoch():
            losses = self._proving(True, lambda batch=batch: self._step(batch))  # type: ignore[misc]
            epoch_steps += 1
        if not epoch_steps:
            raise ValueError(f"workload {self.workload.name!r}: its training data yields no batch")
        final_losses = losses.detach().cpu().tolist()
        train_s = self.epoch_s["train_s"] = time.perf_counter() - clock
        self.member_steps += self.count * epoch_steps
        self.steps += epoch_steps
        self.train_seconds += train_s
        return final_losses, epoch_steps

    def _step(self, batch: Batch) -> torch.Tensor:
        """One optimization step of every member on ``batch``, each tensor of it broadcast to
        the members; their losses."""
        count, workload = self.count, self.workload
        if self.optim.amp:
            with self.optim.autocast():
                out = workload.forward(self.fused, fusion.broadcast(batch, count))
                losses = fusion.per_member_loss(workload.loss, out, fusion.broadcast(workload.target_of(batch), count))
        else:
            out = workload.forward(self.fused, fusion.broadcast(batch, count))
            losses = fusion.per_member_loss(workload.loss, out, fusion.broadcast(workload.target_of(batch), count))
        self.optim.step(losses)
        return losses

    def _probe(self, epoch_steps: int) -> float | None:
        """The class's unfused speed, once, when the spec asks for it (its first epoch)."""
        if not self.spec.probe_solo or self.outcome.epochs_done != 0:
            return None
        clock = time.perf_counter()
        member = self.members[0]
        batches = self.data.train.endless(member.number)
        solo = probe_solo_speed(self.workload, member, batches, self.device, steps=epoch_steps, training=self.spec.training)
        self.epoch_s["probe_s"] = time.perf_counter() - clock
        return solo

    def _evaluate(self) -> tuple[list[float], Evaluation]:
        """The validation pass: each member's first objective and the pass's outputs; the
        schedules step once per epoch, after it."""
        clock = time.perf_counter()
        self.fused.eval()
        with torch.no_grad():
            evaluation = self._proving(False, self._validate)
        values = [_measure(self.metrics[0], self.fused, b, evaluation) for b in range(self.count)]
        self.optim.end_epoch(values)
        self.epoch_s["eval_s"] = time.perf_counter() - clock
        return values, evaluation

    def _validate(self) -> Evaluation:
        """The fused model over the validation batches, each tensor broadcast to the members;
        the metrics of the batch's outputs that are means over batches are taken as it passes."""
        evaluation, workload = Evaluation(self.metrics, self.count), self.workload
        for batch in self.data.validation():
            with self.optim.autocast() if self.optim.amp else contextlib.nullcontext():
                out = workload.forward(self.fused, fusion.broadcast(batch, self.count))
            evaluation.add(out, workload.target_of(batch))
        return evaluation

    def _end_members(self, final_losses: list[float], values: list[float], evaluation: Evaluation) -> list[MemberReport]:
        """Each member's report; members that end on the worker's side: diverged, or done
        (weights saved first)."""
        clock = time.perf_counter()
        spec, outcome, metrics = self.spec, self.outcome, self.metrics
        self.ended = {}
        reports = []
        for b, member in enumerate(self.members):
            self.epochs_done[b] += 1
            step = self.epochs_done[b] - 1
            if not math.isfinite(final_losses[b]) or not math.isfinite(values[b]):
                error = f"training diverged: non-finite loss at epoch {step}"
                reports.append(MemberReport(member.trial_id, step, values[b], "FAIL", error=error))
                self.ended[b], outcome.failed[member.trial_id] = "FAIL", "training diverged"
            elif self.epochs_done[b] >= spec.epochs:
                finals = (values[b], *(_measure(m, self.fused, b, evaluation) for m in metrics[1:]))
                bad = [m.name for m, v in zip(metrics, finals) if not math.isfinite(v)]
                if bad:
                    error = f"objective {bad[0]} is not finite at epoch {step}"
                    reports.append(MemberReport(member.trial_id, step, values[b], "FAIL", error=error))
                    self.ended[b], outcome.failed[member.trial_id] = "FAIL", error
                    continue
                path = save_member(self.fused, b, spec, member) if spec.artifact_dir is not None else None
                reports.append(MemberReport(member.trial_id, step, values[b], "COMPLETE", state_dict=path, values=finals))
                self.ended[b] = "COMPLETE"
                outcome.completed.append(member.trial_id)
            else:
                reports.append(MemberReport(member.trial_id, step, values[b]))
        self.epoch_s["save_s"] = time.perf_counter() - clock
        return reports

    def _release(self) -> None:
        """Members the scheduler preempted leave with their checkpoint (only where there is
        one), on disk before the report lets another array take them."""
        clock = time.perf_counter()
        spec, members = self.spec, self.members
        release = self.inbox.released(spec.array_id) if self.inbox is not None and spec.artifact_dir else set()
        self.leaving = [b for b, m in enumerate(members) if b not in self.ended and m.trial_id in release]
        for b in self.leaving:
            self._save(b)
            self.outcome.released.append(members[b].trial_id)
        if self.leaving:
            self.writer.flush()
        self.epoch_s["checkpoint_s"] = time.perf_counter() - clock

    def _save(self, b: int) -> None:
        """Checkpoint member ``b`` (in the background): weights, optimizer and schedules."""
        self.writer.save(_folder(self.spec, self.members[b]), self.epochs_done[b], self.fused.member_state_dict(b), *self.optim.member_state(b))

    def _report(self, reports: list[MemberReport], epoch_steps: int, solo: float | None) -> EpochReport:
        """The epoch's report. Each member's newest checkpoint that is completely written: what
        the control plane may resume it from (the one being written now may not be there yet)."""
        spec, members = self.spec, self.members
        durable = {m.trial_id: self.writer.durable(_folder(spec, m)) for m in members} if spec.artifact_dir else {}
        report = EpochReport(
            array_id=spec.array_id,
            members=tuple(dataclasses.replace(r, checkpoint_epoch=durable.get(r.trial_id)) for r in reports),
            joined=tuple(self.joined),
            released=tuple(members[b].trial_id for b in self.leaving),
            size=self.count,
            member_steps=self.count * epoch_steps,
            train_seconds=self.epoch_s["train_s"],
            solo_steps_per_s=solo,
            timings=dict(self.epoch_s),
            warnings=self._new_warnings(),
        )
        named = [(_folder(spec, m), done) for m in members if (done := durable.get(m.trial_id)) is not None]
        ended = [_folder(spec, m) for b, m in enumerate(members) if self.ended.get(b) in ("COMPLETE", "FAIL")] if spec.artifact_dir else []
        self.sent.append(_Sent(named, ended))
        return report

    def _new_warnings(self) -> tuple[str, ...]:
        """The modules the fused model runs once per member, not reported yet: exact, but
        without fusion's speed-up, which the study's user should know."""
        if not isinstance(self.fused, fusion.FusedModel):
            return ()
        found = []
        for path, why in self.fused.batched_modules().items():
            if why is None:
                continue
            label = getattr(self.fused.module.get_submodule(path), "label", f"submodule '{path or '<root>'}'")
            text = f"{label} runs once per member, exact but without fusion's speed-up ({why})"
            if text not in self.warned:
                self.warned.add(text)
                found.append(text)
        return tuple(found)

    # -- the boundary ------------------------------------------------------------------------------
    def boundary(self, reply: EpochReply) -> None:
        """After the control plane's reply: its acknowledgements and prunes, the members'
        checkpoints, and the array's membership for the next epoch."""
        self._acknowledged(reply.acked)
        self.joined = []
        for b, member in enumerate(self.members):
            if b not in self.ended and member.trial_id in reply.prune:
                self.ended[b] = "PRUNED"
                self.outcome.pruned.append(member.trial_id)
        for b in self.leaving:
            self.ended[b] = "RELEASED"
        self._checkpoint()
        self._change_membership()
        for phase, seconds in self.epoch_s.items():
            self.timings[phase] += seconds

    def _acknowledged(self, acked: int) -> None:
        """The control plane recorded the ``acked`` oldest reports not acknowledged yet: the
        checkpoints older than those they named go, and every checkpoint of the members that
        ended in them.

        Not before: a worker whose scheduler died (killed, cut off) trains on until Ray
        stops it, and a standby that took over resumes its members from the checkpoints the
        dead scheduler recorded. Were a member's checkpoints removed when the worker saw it
        complete, that member would restart from scratch there.
        """
        for _ in range(min(acked, len(self.sent))):
            sent = self.sent.popleft()
            for folder, done in sent.checkpoints:
                self.writer.confirm(folder, done)
            for folder in sent.ended:
                self.writer.remove(folder)

    def _checkpoint(self) -> None:
        """Checkpoints in the background: the next epoch does not wait for the disk. A member
        is saved once checkpoint_frequency epochs and checkpoint_interval_s seconds of
        training have passed since its last checkpoint; the checkpoints of members the
        control plane pruned go (those that completed or failed go once the report that
        says so is acknowledged: :meth:`_acknowledged`)."""
        clock = time.perf_counter()
        spec = self.spec
        if spec.artifact_dir is not None:
            for b, member in enumerate(self.members):
                if self.ended.get(b, "RELEASED") != "RELEASED":
                    if self.ended[b] == "PRUNED":  # the control plane's own decision: recorded
                        self.writer.remove(_folder(spec, member))
                    self.last_saved.pop(member.trial_id, None)
                    continue
                epochs_at, seconds_at = self.last_saved.setdefault(
                    member.trial_id, (self.epochs_done[b] - 1, self.train_seconds - self.epoch_s["train_s"])
                )
                if (
                    b not in self.ended
                    and spec.checkpoint_frequency
                    and self.epochs_done[b] - epochs_at >= spec.checkpoint_frequency
                    and self.train_seconds - seconds_at >= spec.checkpoint_interval_s
                ):
                    self._save(b)
                    self.last_saved[member.trial_id] = (self.epochs_done[b], self.train_seconds)
        self.epoch_s["checkpoint_s"] += time.perf_counter() - clock

    def _change_membership(self) -> None:
        """The members that ended leave the fused model; newcomers waiting in the inbox join
        it, or make a fresh one where every member ended."""
        clock = time.perf_counter()
        spec, count, ended = self.spec, self.count, self.ended
        newcomers = self.inbox.take(spec.array_id, self.outcome.epochs_done) if self.inbox is not None else []
        if ended and len(ended) < count:
            self.fused.remove_members(sorted(ended))
            self.optim.remove_members(sorted(ended))
        keep = [b for b in range(count) if b not in ended]
        self.members, self.epochs_done = [self.members[b] for b in keep], [self.epochs_done[b] for b in keep]
        if newcomers:
            models = build_models(self.workload, newcomers, spec.seed)
            new_epochs, new_states = resume_members(spec, newcomers, models)
            _resumed(self.writer, spec, newcomers, new_epochs, new_states)
            new_recipes = recipes(self.workload, spec.training, newcomers)
            if self.members:
                self.fused.add_members(models)
                self.optim.add_members(new_recipes)
            else:  # every member ended at this boundary: the newcomers make a fresh array
                self.fused = self._fuse(models, newcomers)
                self.optim = _optimizer(self.fused, new_recipes, self.device)
            _load_states(self.optim, len(self.members), new_states)
            self.joined = _joined(newcomers, new_epochs, new_states)
            self.members += newcomers
            self.epochs_done += new_epochs
        self.epoch_s["build_s"] += time.perf_counter() - clock

    # -- the end -----------------------------------------------------------------------------------
    def finish(self) -> None:
        """Every member has ended: the checkpoints are written (those of the members that
        ended removed once their reports are acknowledged), the array's speed measured."""
        if self.sent and any(sent.ended for sent in self.sent):
            owed = len(self.sent)
            # Without a control plane (the library's own use) nothing acknowledges: all is recorded.
            acked = self.inbox.acknowledged(self.spec.array_id, owed, self.spec.reply_timeout_s) if self.inbox else owed
            self._acknowledged(acked)
        self.writer.flush()
        if self.train_seconds > 0:
            self.outcome.models_steps_per_s = self.member_steps / self.train_seconds
            self.outcome.members = round(self.member_steps / self.steps)

    def not_fused(self, error: Exception) -> None:
        """The fused model failed to build, or its first step or evaluation, with ``error``.
        If the first member's own model trains, the model fuses by neither path: the outcome
        says why, naming the module, and its members (not failed, their checkpoints kept)
        train unfused. Otherwise the model cannot train at all: the array fails with ``error``."""
        member, workload = self.fusing, self.workload
        try:
            batches = self.data.train.endless(member.number)
            probe_solo_speed(workload, member, batches, self.device, steps=1, warmup=0, training=self.spec.training)
            model = workload.build_model(member.params).to(self.device).eval()
            batch = self.data.first_validation()
            with torch.no_grad():  # its metrics too: a metric's own failure is no fusion's
                check = Evaluation(self.metrics, 1)
                check.add(fusion.broadcast(workload.forward(model, batch), 1), workload.target_of(batch))
                for metric in self.metrics:
                    if metric.of == "outputs":
                        check.value(metric, 0)
        except Exception:
            self.fail(error)
            return
        self.outcome.unfusible = f"{where_it_failed(error, model)}: {_said(error)}"
        earlier = error.__context__ if error.__cause__ is None else None
        if earlier is not None:  # the per-member loop failed where vmap had failed first
            self.outcome.unfusible += f" (raised while handling {_said(earlier)})"
        self.outcome.error = f"it fuses by neither path (its trials train unfused): {self.outcome.unfusible}"
        log.warning("array %d: %s", self.spec.array_id, self.outcome.error)

    def fail(self, exc: Exception) -> None:
        """The array fails as a whole: every member still training records why."""
        self.outcome.error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, PackageError):  # the tenant's code: its study fails, not just these members
            self.outcome.package_error = str(exc)
        # Out of memory: the control plane splits the array and retries the halves, which
        # resume from the members' checkpoints; any other error fails the members.
        self.outcome.oom = is_out_of_memory(exc)
        detail = self.outcome.error + "\n" + "".join(traceback.format_exception(exc, limit=-_TRACEBACK_FRAMES))
        for member in self.members:
            self.outcome.failed.setdefault(member.trial_id, detail)
            key = _checkpoint_of(self.spec, member)
            if key is not None and not self.outcome.oom:
                self.writer.remove(key)

    def close(self) -> None:
        """Whatever ended the array: its checkpoints written (or the error that stopped them)."""
        try:
            self.writer.close()
        except OSError as exc:  # a checkpoint could not be written: the trials can't resume
            self.outcome.error = self.outcome.error or f"checkpoint write failed: {exc}"
        data = getattr(self, "data", None)  # None: the array failed before it read its data
        if data is not None:
            data.close()
        if self.outcome.oom and self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the failed array held, for the halves
        self.outcome.timings = dict(self.timings)
