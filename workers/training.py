"""Training one array: B trials of a workload as one fused model, reporting every epoch."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import traceback
from collections import defaultdict, deque
from collections.abc import Generator, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

import fusetune.fusion as fusion
from fusetune.workers.checkpoints import CheckpointWriter, UnreadableCheckpoint, checkpoint_dir, load_checkpoint, saved_epochs
from fusetune.workers.optimization import ArrayOptimizer, Recipe, optimizer_kwargs, resolve
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
from fusetune.workers.workloads import Metric, Workload, get_workload

log = logging.getLogger(__name__)

__all__ = ["build_models", "objectives", "optimizer_kwargs", "probe_solo_speed", "recipes", "train_array"]


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


def save_member(fused: fusion.FusedModel, index: int, spec: ArraySpec, member: MemberSpec) -> str:
    """Save member ``index`` as a plain state_dict of the workload's model class in the
    artifact store; returns where (a local path, or the store's URI of it)."""
    state = {k: v.detach().cpu() for k, v in fused.member_state_dict(index).items()}
    return get_store(spec.artifact_dir).save_torch(f"{spec.study_name}/trial-{member.number}.pt", state)


def _checkpoint_of(spec: ArraySpec, member: MemberSpec) -> str | None:
    """The store folder of the member's checkpoints (None: the array keeps none)."""
    return checkpoint_dir(spec.study_name, member.number) if spec.artifact_dir else None


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
            writer.assume(_checkpoint_of(spec, member), done)
            writer.confirm(_checkpoint_of(spec, member), done, newer=True)
        elif member.resume_epoch is not None:
            writer.remove(_checkpoint_of(spec, member))


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
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    warmup: int = 3,
    training: TrainingSpec | None = None,
) -> float:
    """Steps/s of one member's model trained alone, unfused, on the array's own data.

    It is the B = 1 point of the class's speed-up curve: with the array's own measured
    speed it tells the scheduler what fusing gains on this device, instead of the dry runs
    that used to delay a class's first array. A copy trains (from the member's init seed,
    one epoch's worth of steps at most) with torch's own optimizer, clipping and AMP as the
    member's recipe says, so the member itself is untouched.
    """
    device = x.device
    batch = workload.batch_size_for(member.params)
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
        idx = torch.randint(len(y), (batch,), device=device)
        with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
            loss = workload.loss(model(x[idx]), y[idx])
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


def _measure(metric: Metric, fused: fusion.FusedModel, b: int, out: torch.Tensor, target: torch.Tensor) -> float:
    """Member ``b``'s value of ``metric``: from the fused validation outputs, or of its model."""
    with torch.no_grad():
        if metric.of == "model":
            return float(metric.fn(fused.member(b)))
        return float(metric.fn(out[b], target))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Inbox(Protocol):
    """Where newcomers for a running array wait for its next epoch boundary."""

    def take(self, array_id: int, epochs_done: int = 0) -> list[MemberSpec]: ...

    def released(self, array_id: int) -> set[int]: ...


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
    """
    outcome = ArrayOutcome(array_id=spec.array_id)
    timings: dict[str, float] = defaultdict(float)
    members: list[MemberSpec] = list(spec.members)
    writer = CheckpointWriter(get_store(spec.artifact_dir) if spec.artifact_dir else None)
    last_saved: dict[int, tuple[int, float]] = {}  # trial id -> (epochs done, train seconds) at its last checkpoint
    sent: deque[list[tuple[str, int]]] = deque()  # per report not yet acknowledged: the checkpoints it named
    try:
        clock = time.perf_counter()
        workload = get_workload(spec.workload)
        train, val = workload.datasets()
        x, y = (t.to(device) for t in train.tensors)
        x_val, y_val = (t.to(device) for t in val.tensors)
        metrics = objectives(workload, spec.training)
        models = build_models(workload, members, spec.seed)
        epochs_done, states = resume_members(spec, members, models)
        _resumed(writer, spec, members, epochs_done, states)
        fused = fusion.fuse(models).to(device)
        optim = ArrayOptimizer(fused, recipes(workload, spec.training, members), device)
        _load_states(optim, 0, states)
        joined = _joined(members, epochs_done, states)
        batch_size = workload.batch_size_for(members[0].params)
        # The data order is the array's members' (the first's number), not the array id's,
        # which depends on how the database numbered earlier arrays.
        generator = torch.Generator().manual_seed(spec.seed + min(m.number for m in members))
        member_steps, steps, train_seconds = 0, 0, 0.0
        # In the first epoch's report: the control plane weighs moving members by it.
        built = time.perf_counter() - clock

        while members:
            epoch = defaultdict(float)
            epoch["build_s"], built = built, 0.0
            count = len(members)
            fused.train()
            clock = time.perf_counter()
            order = torch.randperm(len(y), generator=generator).to(device)
            losses = torch.zeros(count, device=device)
            epoch_steps = 0
            for begin in range(0, len(y), batch_size):
                idx = order[begin : begin + batch_size]
                if optim.amp:
                    with optim.autocast():
                        out = fused(fusion.broadcast(x[idx], count))
                        losses = fusion.per_member_loss(workload.loss, out, fusion.broadcast(y[idx], count))
                else:
                    out = fused(fusion.broadcast(x[idx], count))
                    losses = fusion.per_member_loss(workload.loss, out, fusion.broadcast(y[idx], count))
                optim.step(losses)
                epoch_steps += 1
            final_losses = losses.detach().cpu().tolist()
            epoch["train_s"] = time.perf_counter() - clock
            member_steps, steps, train_seconds = member_steps + count * epoch_steps, steps + epoch_steps, train_seconds + epoch["train_s"]
            solo = None
            if spec.probe_solo and outcome.epochs_done == 0:
                clock = time.perf_counter()
                solo = probe_solo_speed(workload, members[0], x, y, steps=epoch_steps, training=spec.training)
                epoch["probe_s"] = time.perf_counter() - clock

            clock = time.perf_counter()
            fused.eval()
            with torch.no_grad(), optim.autocast() if optim.amp else contextlib.nullcontext():
                out = fused(fusion.broadcast(x_val, count))
            values = [_measure(metrics[0], fused, b, out, y_val) for b in range(count)]
            optim.end_epoch(values)  # schedules step once per epoch, after validation
            epoch["eval_s"] = time.perf_counter() - clock
            outcome.epochs_done += 1

            # Members that end on the worker's side: diverged, or done (weights saved first).
            clock = time.perf_counter()
            ended: dict[int, str] = {}
            reports = []
            for b, member in enumerate(members):
                epochs_done[b] += 1
                step = epochs_done[b] - 1
                if not math.isfinite(final_losses[b]) or not math.isfinite(values[b]):
                    error = f"training diverged: non-finite loss at epoch {step}"
                    reports.append(MemberReport(member.trial_id, step, values[b], "FAIL", error=error))
                    ended[b], outcome.failed[member.trial_id] = "FAIL", "training diverged"
                elif epochs_done[b] >= spec.epochs:
                    finals = (values[b], *(_measure(m, fused, b, out, y_val) for m in metrics[1:]))
                    bad = [m.name for m, v in zip(metrics, finals) if not math.isfinite(v)]
                    if bad:
                        error = f"objective {bad[0]} is not finite at epoch {step}"
                        reports.append(MemberReport(member.trial_id, step, values[b], "FAIL", error=error))
                        ended[b], outcome.failed[member.trial_id] = "FAIL", error
                        continue
                    path = save_member(fused, b, spec, member) if spec.artifact_dir is not None else None
                    reports.append(MemberReport(member.trial_id, step, values[b], "COMPLETE", state_dict=path, values=finals))
                    ended[b] = "COMPLETE"
                    outcome.completed.append(member.trial_id)
                else:
                    reports.append(MemberReport(member.trial_id, step, values[b]))
            epoch["save_s"] = time.perf_counter() - clock

            # Members the scheduler preempted leave with their checkpoint (only where there is
            # one), on disk before the report lets another array take them.
            clock = time.perf_counter()
            release = inbox.released(spec.array_id) if inbox is not None and spec.artifact_dir else set()
            leaving = [b for b, m in enumerate(members) if b not in ended and m.trial_id in release]
            for b in leaving:
                writer.save(_checkpoint_of(spec, members[b]), epochs_done[b], fused.member_state_dict(b), *optim.member_state(b))
                outcome.released.append(members[b].trial_id)
            if leaving:
                writer.flush()
            epoch["checkpoint_s"] = time.perf_counter() - clock

            # Each member's newest checkpoint that is completely written: what the control
            # plane may resume it from (the one being written now may not be there yet).
            durable = {m.trial_id: writer.durable(_checkpoint_of(spec, m)) for m in members} if spec.artifact_dir else {}
            report = EpochReport(
                array_id=spec.array_id,
                members=tuple(dataclasses.replace(r, checkpoint_epoch=durable.get(r.trial_id)) for r in reports),
                joined=tuple(joined),
                released=tuple(members[b].trial_id for b in leaving),
                size=count,
                member_steps=count * epoch_steps,
                train_seconds=epoch["train_s"],
                solo_steps_per_s=solo,
                timings=dict(epoch),
            )
            sent.append([(_checkpoint_of(spec, m), durable[m.trial_id]) for m in members if durable.get(m.trial_id) is not None])
            clock = time.perf_counter()
            reply = (yield report) or EpochReply()
            timings["report_s"] += time.perf_counter() - clock
            for _ in range(min(reply.acked, len(sent))):  # recorded: the older checkpoints can go
                for folder, done in sent.popleft():
                    writer.confirm(folder, done)
            joined = []
            for b, member in enumerate(members):
                if b not in ended and member.trial_id in reply.prune:
                    ended[b] = "PRUNED"
                    outcome.pruned.append(member.trial_id)
            for b in leaving:
                ended[b] = "RELEASED"

            # Checkpoints in the background: the next epoch does not wait for the disk. A member
            # is saved once checkpoint_frequency epochs and checkpoint_interval_s seconds of
            # training have passed since its last checkpoint.
            clock = time.perf_counter()
            if spec.artifact_dir is not None:
                for b, member in enumerate(members):
                    if ended.get(b, "RELEASED") != "RELEASED":
                        writer.remove(_checkpoint_of(spec, member))
                        last_saved.pop(member.trial_id, None)
                        continue
                    epochs_at, seconds_at = last_saved.setdefault(member.trial_id, (epochs_done[b] - 1, train_seconds - epoch["train_s"]))
                    if (
                        b not in ended
                        and spec.checkpoint_frequency
                        and epochs_done[b] - epochs_at >= spec.checkpoint_frequency
                        and train_seconds - seconds_at >= spec.checkpoint_interval_s
                    ):
                        writer.save(_checkpoint_of(spec, member), epochs_done[b], fused.member_state_dict(b), *optim.member_state(b))
                        last_saved[member.trial_id] = (epochs_done[b], train_seconds)
            epoch["checkpoint_s"] += time.perf_counter() - clock

            clock = time.perf_counter()
            newcomers = inbox.take(spec.array_id, outcome.epochs_done) if inbox is not None else []
            if ended and len(ended) < count:
                fused.remove_members(sorted(ended))
                optim.remove_members(sorted(ended))
            keep = [b for b in range(count) if b not in ended]
            members, epochs_done = [members[b] for b in keep], [epochs_done[b] for b in keep]
            if newcomers:
                models = build_models(workload, newcomers, spec.seed)
                new_epochs, new_states = resume_members(spec, newcomers, models)
                _resumed(writer, spec, newcomers, new_epochs, new_states)
                if members:
                    fused.add_members(models)
                    optim.add_members(recipes(workload, spec.training, newcomers))
                else:  # every member ended at this boundary: the newcomers make a fresh array
                    fused = fusion.fuse(models).to(device)
                    optim = ArrayOptimizer(fused, recipes(workload, spec.training, newcomers), device)
                _load_states(optim, len(members), new_states)
                joined = _joined(newcomers, new_epochs, new_states)
                members += newcomers
                epochs_done += new_epochs
            epoch["build_s"] += time.perf_counter() - clock
            for phase, seconds in epoch.items():
                timings[phase] += seconds

        writer.flush()
        if train_seconds > 0:
            outcome.models_steps_per_s = member_steps / train_seconds
            outcome.members = round(member_steps / steps)
    except Exception as exc:  # the array fails as a whole; every member still training records why
        outcome.error = f"{type(exc).__name__}: {exc}"
        # Out of memory: the control plane splits the array and retries the halves, which
        # resume from the members' checkpoints; any other error fails the members.
        outcome.oom = is_out_of_memory(exc)
        detail = outcome.error + "\n" + traceback.format_exc(limit=5)
        for member in members:
            outcome.failed.setdefault(member.trial_id, detail)
            key = _checkpoint_of(spec, member)
            if key is not None and not outcome.oom:
                writer.remove(key)
    finally:
        try:
            writer.close()
        except OSError as exc:  # a checkpoint could not be written: the trials can't resume
            outcome.error = outcome.error or f"checkpoint write failed: {exc}"
        if outcome.oom and device.type == "cuda":
            torch.cuda.empty_cache()  # what the failed array held, for the halves
    outcome.timings = dict(timings)
    return outcome
