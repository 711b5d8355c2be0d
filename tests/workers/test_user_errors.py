"""What a member's error says when the tenant's code is at fault: where it raised, and which
part of the workload did what."""

from __future__ import annotations

from pathlib import Path

from tests.workers.test_optimization import run, spec_of


def test_a_members_error_ends_with_the_frames_of_the_code_that_raised(tmp_path: Path) -> None:
    """The innermost frames are kept (the tenant's loss here), not the outermost, which are
    always the worker's own."""
    spec = spec_of(tmp_path, [{"hidden": 16}, {"hidden": 16}], workload="tests.surrogate_workload:UNTRAINABLE")
    _, outcome = run(spec)
    detail = outcome.failed[100]
    # The loss failed under vmap, then in the per-member loop: both tracebacks reach it.
    for raised in detail.split("During handling of the above exception")[-2:]:
        assert "surrogate_workload.py" in raised and "in untrainable_loss" in raised, detail
    assert detail.rstrip().endswith("broke")


def test_a_metric_that_returns_no_number_is_named(tmp_path: Path) -> None:
    _, outcome = run(spec_of(tmp_path, [{"hidden": 16}], workload="tests.workers.slip_workloads:TEXT_METRIC"))
    assert outcome.error is not None
    assert "metric 'verdict' returned 'good' (str), not a number" in outcome.error, outcome.error


def test_datasets_that_return_one_dataset_say_so(tmp_path: Path) -> None:
    _, outcome = run(spec_of(tmp_path, [{"hidden": 16}], workload="tests.workers.slip_workloads:ONE_DATASET"))
    assert outcome.error is not None
    assert "datasets() returned a TensorDataset, not the pair (train, validation)" in outcome.error, outcome.error
