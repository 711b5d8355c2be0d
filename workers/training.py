"""Training one array: B trials of a workload as one fused model, reporting every epoch."""

from __future__ import annotations

import math
import time
import traceback
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

import fusion
import fusion.sizing
from workers.checkpoints import checkpoint_path, load_checkpoint, remove_checkpoint, save_checkpoint
from workers.reporting import Reporter
from workers.spec import ArrayOutcome, ArraySpec, MemberSpec
from workers.workloads import Workload, get_workload

#: Per-member hyper-parameters each optimizer takes from a trial's params, with torch's defaults.
OPTIMIZER_HPARAMS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0},
    "adam": {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999},
}


def optimizer_kwargs(workload: Workload, params: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Per-member optimizer hyper-parameters: the trial's value, else the workload's, else torch's."""
    defaults = OPTIMIZER_HPARAMS[workload.optimizer]
    per_member = [
        {name: p.get(name, workload.optimizer_defaults.get(name, default)) for name, default in defaults.items()}
        for p in params
    ]
    kwargs = {name: [m[name] for m in per_member] for name in defaults if not name.startswith("beta")}
    if workload.optimizer == "adam":
        kwargs["betas"] = [(m["beta1"], m["beta2"]) for m in per_member]
    return kwargs


def make_optimizer(workload: Workload, model: nn.Module, params: Sequence[Mapping[str, Any]]) -> torch.optim.Optimizer:
    cls = {"sgd": fusion.optim.SGD, "adam": fusion.optim.Adam}[workload.optimizer]
    return cls(model.parameters(), **optimizer_kwargs(workload, params))


def build_models(workload: Workload, members: Sequence[MemberSpec], seed: int) -> list[nn.Module]:
    """One model per member, each initialised from its own seed so results are reproducible."""
    models = []
    for member in members:
        torch.manual_seed(seed + member.number)
        models.append(workload.build_model(member.params))
    return models


def save_member(fused: fusion.FusedModel, index: int, spec: ArraySpec, member: MemberSpec) -> str:
    """Save member ``index`` as a plain state_dict of the workload's model class; returns the path."""
    path = Path(spec.artifact_dir, spec.study_name, f"trial-{member.number}.pt")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().cpu() for k, v in fused.member_state_dict(index).items()}, path)
    return str(path)


def _checkpoint_of(spec: ArraySpec, member: MemberSpec) -> Path | None:
    return checkpoint_path(spec.artifact_dir, spec.study_name, member.number) if spec.artifact_dir else None


def resume_members(
    spec: ArraySpec, members: Sequence[MemberSpec], models: Sequence[nn.Module]
) -> tuple[list[int], list[dict[str, Any] | None]]:
    """Load the checkpointed weights of the members that have a checkpoint into ``models``.

    Returns each member's epochs done (0 when starting fresh) and its optimizer state to
    load once the fused optimizer exists (None when fresh).
    """
    epochs, optimizer_states = [], []
    for member, model in zip(members, models, strict=True):
        path = _checkpoint_of(spec, member)
        ckpt = load_checkpoint(path) if path is not None else None
        if ckpt is None:
            epochs.append(0)
            optimizer_states.append(None)
            continue
        model.load_state_dict(ckpt["model"], strict=True)
        epochs.append(int(ckpt["epochs_done"]))
        optimizer_states.append(ckpt["optimizer"])
    return epochs, optimizer_states


def size_on_device(
    workload: Workload, spec: ArraySpec, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> fusion.sizing.SizingResult:
    """The fusion engine's dry runs for this array's signature on this device (cached per process).

    They measure the largest B that fits and the models·steps/s of each B against an unfused
    model, which the scheduler turns into its throughput curve for the device type.
    """
    params = spec.members[0].params
    batch = workload.batch_size_for(params)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # Time with one thread: millisecond steps timed on shared cores with several OpenMP
        # threads measure mostly the threads' spinning against other processes.
        torch.set_num_threads(1)
    try:
        return fusion.sizing.size_array(
            lambda: workload.build_model(params),
            x[:batch],
            y[:batch],
            device=device,
            loss_fn=workload.loss,
            optimizer=workload.optimizer,
            candidates=(1, 2, 4, 8, 16),
            signature=spec.signature,
        )
    finally:
        torch.set_num_threads(threads)


class Inbox(Protocol):
    """Where newcomers for a running array wait for its next epoch boundary."""

    def take(self, array_id: int) -> list[MemberSpec]: ...

    def released(self, array_id: int) -> set[int]: ...


def train_array(
    spec: ArraySpec, device: torch.device, reporter: Reporter | None = None, inbox: Inbox | None = None
) -> ArrayOutcome:
    """Train ``spec``'s members as one fused model, each for ``spec.epochs`` epochs.

    After every epoch each member's validation metric is reported. Members end on their own:
    after their last epoch, when their pruner says so, or when their loss stops being finite;
    the rest keep training, and the ended ones leave the fused model. Newcomers waiting in
    ``inbox`` join at the epoch boundary with fresh weights and optimizer state, so members
    of one array can be at different epochs. With an ``artifact_dir``, every member that
    trains on is checkpointed at each epoch boundary (``workers.checkpoints``), and a member
    that has a checkpoint (its last worker died) resumes from it: weights, optimizer state
    and epoch count (the data order of its later epochs differs). Members the scheduler
    preempts (``inbox.released``) leave at the next epoch boundary with their checkpoint,
    waiting for another array. Any other error fails the whole array, with the error recorded.
    """
    reporter = reporter or Reporter(spec)
    outcome = ArrayOutcome(array_id=spec.array_id)
    members: list[MemberSpec] = list(spec.members)
    epochs_done: list[int] = [0] * len(members)
    try:
        workload = get_workload(spec.workload)
        reporter.started(members)
        train, val = workload.datasets()
        x, y = (t.to(device) for t in train.tensors)
        x_val, y_val = (t.to(device) for t in val.tensors)
        outcome.sizing = size_on_device(workload, spec, x, y, device).to_json()
        models = build_models(workload, members, spec.seed)
        epochs_done, optimizer_states = resume_members(spec, members, models)
        fused = fusion.fuse(models).to(device)
        optimizer = make_optimizer(workload, fused, [m.params for m in members])
        for b, state in enumerate(optimizer_states):
            if state is not None:
                optimizer.load_member_state_dict(b, state)
                reporter.resumed(members[b], epochs_done[b])
        batch_size = workload.batch_size_for(members[0].params)
        generator = torch.Generator().manual_seed(spec.seed)
        member_steps, steps, train_seconds = 0, 0, 0.0

        while members:
            count = len(members)
            fused.train()
            start = time.perf_counter()
            order = torch.randperm(len(y), generator=generator).to(device)
            losses = torch.zeros(count, device=device)
            for begin in range(0, len(y), batch_size):
                idx = order[begin : begin + batch_size]
                out = fused(fusion.broadcast(x[idx], count))
                losses = fusion.per_member_loss(workload.loss, out, fusion.broadcast(y[idx], count))
                optimizer.zero_grad(set_to_none=True)
                losses.sum().backward()
                optimizer.step()
                member_steps, steps = member_steps + count, steps + 1
            train_seconds += time.perf_counter() - start

            fused.eval()
            with torch.no_grad():
                out = fused(fusion.broadcast(x_val, count))
            values = [float(workload.metric(out[b], y_val)) for b in range(count)]
            final_losses = losses.detach().cpu().tolist()
            outcome.epochs_done += 1

            ended = []
            for b in range(count):
                epochs_done[b] += 1
                if not math.isfinite(final_losses[b]) or not math.isfinite(values[b]):
                    reporter.fail(members[b], f"training diverged: non-finite loss at epoch {epochs_done[b] - 1}")
                    outcome.failed[members[b].trial_id] = "training diverged"
                    ended.append(b)
            going = [b for b in range(count) if b not in ended]
            prune = reporter.epoch(
                [members[b] for b in going], [epochs_done[b] - 1 for b in going], [values[b] for b in going]
            )
            for b, should_prune in zip(going, prune, strict=True):
                if epochs_done[b] >= spec.epochs:
                    if spec.artifact_dir is not None:
                        reporter.saved(members[b], save_member(fused, b, spec, members[b]))
                    reporter.complete(members[b], values[b])
                    outcome.completed.append(members[b].trial_id)
                    ended.append(b)
                elif should_prune:
                    reporter.pruned(members[b], values[b])
                    outcome.pruned.append(members[b].trial_id)
                    ended.append(b)

            # Members the scheduler preempted leave with their checkpoint (only where there is one).
            release = inbox.released(spec.array_id) if inbox is not None and spec.artifact_dir else set()
            leaving = [b for b in range(count) if b not in ended and members[b].trial_id in release]
            for b in range(count):
                path = _checkpoint_of(spec, members[b])
                if path is None:
                    continue
                if b in ended:
                    remove_checkpoint(path)
                else:
                    save_checkpoint(path, epochs_done[b], fused.member_state_dict(b), optimizer.member_state_dict(b))
            for b in leaving:
                reporter.released(members[b])
                outcome.released.append(members[b].trial_id)
            ended += leaving

            newcomers = inbox.take(spec.array_id) if inbox is not None else []
            if ended and len(ended) < count:
                fused.remove_members(ended)
                optimizer.remove_members(ended)
            keep = [b for b in range(count) if b not in ended]
            members, epochs_done = [members[b] for b in keep], [epochs_done[b] for b in keep]
            if newcomers:
                reporter.started(newcomers)
                models = build_models(workload, newcomers, spec.seed)
                new_epochs, new_states = resume_members(spec, newcomers, models)
                if members:
                    fused.add_members(models)
                    optimizer.add_members(len(newcomers), **optimizer_kwargs(workload, [m.params for m in newcomers]))
                else:  # every member ended at this boundary: the newcomers make a fresh array
                    fused = fusion.fuse(models).to(device)
                    optimizer = make_optimizer(workload, fused, [m.params for m in newcomers])
                for k, state in enumerate(new_states):
                    if state is not None:
                        optimizer.load_member_state_dict(len(members) + k, state)
                        reporter.resumed(newcomers[k], new_epochs[k])
                members += newcomers
                epochs_done += new_epochs

        if train_seconds > 0:
            outcome.models_steps_per_s = member_steps / train_seconds
            outcome.members = round(member_steps / steps)
    except Exception as exc:  # the array fails as a whole; every member still training records why
        outcome.error = f"{type(exc).__name__}: {exc}"
        detail = outcome.error + "\n" + traceback.format_exc(limit=5)
        for member in members:
            reporter.fail(member, detail)
            outcome.failed[member.trial_id] = outcome.error
            path = _checkpoint_of(spec, member)
            if path is not None:
                remove_checkpoint(path)
    return outcome
