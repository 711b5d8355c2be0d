"""An array's tensors go when the array ends, not when Python's cyclic collector next runs.

A GPU worker trains array after array in one process. Tensors kept alive by a reference
cycle hold device memory until the collector happens to run (it counts Python objects, not
bytes), so the next array, or the halves of an array that ran out of memory, would run out
too. On an H200 that is what the out-of-memory split test saw (docs/benchmarks.md, "GPU
run"). Two holders were found: the fused tree's builder held every fused layer in a cycle,
and the first optimizer a process builds imports ``torch._dynamo``, whose ``torch.fx.wrap``
keeps the importing frames (the array's, with all it holds) for good. These tests run with
the collector off, on the CPU, where the same objects hold the same references; the array
runs in a fresh interpreter, as a worker's first array does.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator

import pytest
import torch

import fusetune.fusion as fusion
from fusetune.workers.spec import ArrayOutcome, ArraySpec, MemberSpec
from fusetune.workers.training import build_models, train_array
from fusetune.workers.workloads import get_workload


@pytest.fixture
def no_cyclic_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def run(spec: ArraySpec) -> ArrayOutcome:
    training = train_array(spec, torch.device("cpu"))
    next(training)
    try:
        while True:
            training.send(None)
    except StopIteration as stop:
        return stop.value


@pytest.mark.parametrize("workload", ["digits-mlp", "digits-cnn"])
def test_a_fused_models_tensors_go_with_its_last_reference(workload: str, no_cyclic_collector: None) -> None:
    members = [MemberSpec(i, i, i, {}) for i in range(3)]
    fused = fusion.fuse(build_models(get_workload(workload), members, seed=0))
    tensors = [weakref.ref(t) for t in [*fused.parameters(), *fused.buffers()]]
    del fused
    assert [ref() for ref in tensors if ref() is not None] == []


def first_array_of_a_process() -> str:
    """Train one array with the cyclic collector off; the live tensors before and after it."""
    get_workload("digits-mlp").datasets()  # cached for the process: not the array's
    assert "torch._dynamo" not in sys.modules, "the array must be the process's first optimizer"
    params = {"hidden": 32, "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}
    spec = ArraySpec(
        array_id=1, signature="memory", study_name="memory", workload="digits-mlp", epochs=2,
        members=tuple(MemberSpec(i, i, i, params) for i in range(3)), artifact_dir=None, prunes=False,
    )
    gc.collect()
    gc.disable()
    before = live_tensors()
    outcome = run(spec)
    assert outcome.error is None and sorted(outcome.completed) == [0, 1, 2], outcome
    del outcome
    return f"{before} {live_tensors()}"


def test_an_ended_array_leaves_no_tensor_behind() -> None:
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    before, after = child.stdout.split()[-2:]
    assert after == before, f"{int(after) - int(before)} tensors of the ended array are still alive"


if __name__ == "__main__":
    print(first_array_of_a_process())
