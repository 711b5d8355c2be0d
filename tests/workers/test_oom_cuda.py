"""An array that runs out of CUDA memory ends with ``ArrayOutcome.oom``, keeps its members'
checkpoints, and its halves train: no trial fails for it (runs where a GPU is; benchmarks/gpu.sh).

The GPU's memory is capped for this process (``torch.cuda.set_per_process_memory_fraction``)
a little above what 3.5 members need by the fusion engine's memory model, so an array of 8
runs out for real, and so does one of 4. The control plane's rule (``Throughput.split_on_oom``:
the class's arrays are capped at half the size that ran out, and the members wait again) is
applied here as the scheduling loop applies it, without a database.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusetune.fusion.sizing import memory_model
from fusetune.workers.spec import ArrayOutcome, ArraySpec, MemberSpec
from fusetune.workers.training import train_array
from fusetune.workers.workloads import get_workload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PARAMS = {"hidden": 4096, "momentum": 0.9, "weight_decay": 1e-4, "batch_size": 512}


def drive(spec: ArraySpec, device: torch.device) -> tuple[ArrayOutcome, dict[int, list[int]]]:
    """Run ``train_array`` to its end, as a worker does; returns the outcome and each member's steps."""
    steps: dict[int, list[int]] = {}
    training = train_array(spec, device)
    try:
        report = next(training)
        while True:
            for m in report.members:
                steps.setdefault(m.trial_id, []).append(m.step)
            report = training.send(None)
    except StopIteration as stop:
        return stop.value, steps


def test_an_array_out_of_cuda_memory_is_split_and_its_halves_train(tmp_path: Path) -> None:
    # An index: set_per_process_memory_fraction refuses a bare "cuda" (torch 2.11).
    device = torch.device("cuda", torch.cuda.current_device())
    workload = get_workload("digits-mlp")
    x, y = workload.datasets()[0].tensors
    base, member = memory_model(lambda: workload.build_model(PARAMS), x[:512], y[:512], device=device, loss_fn=workload.loss, optimizer="sgd")
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    limit = torch.cuda.memory_reserved(device) + base + int(3.5 * member)
    torch.cuda.set_per_process_memory_fraction(limit / total, device)
    try:
        members = [MemberSpec(i, i, i, {**PARAMS, "lr": 0.01 * (i + 1)}) for i in range(8)]
        queue, sizes, completed = [members], [], {}
        cap = len(members)
        while queue:
            group = queue.pop(0)
            spec = ArraySpec(
                array_id=len(sizes), signature="oom", study_name="oom", workload="digits-mlp", epochs=2,
                members=tuple(group), artifact_dir=str(tmp_path), checkpoint_interval_s=0, prunes=False,
            )
            outcome, steps = drive(spec, device)
            sizes.append(len(group))
            if outcome.oom:
                assert len(group) > 1, "one member alone does not fit: the limit is too low for the test"
                cap = min(cap, len(group) // 2)
                queue += [group[k : k + cap] for k in range(0, len(group), cap)]
                continue
            assert outcome.error is None, outcome.error
            for trial_id in outcome.completed:
                completed[trial_id] = steps[trial_id]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert sizes == [8, 4, 4, 2, 2, 2, 2]  # 8 ran out, then each 4, and the halves of 2 fit
    assert sorted(completed) == list(range(8))  # no trial failed for it
    assert all(s == [0, 1] for s in completed.values())
