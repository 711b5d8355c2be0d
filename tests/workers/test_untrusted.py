"""What the control plane decodes of what a process running a tenant's code sends
(workers/untrusted.py): the protocol's classes, and nothing that would run code here."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import ray

from fusetune.workers.package import PackageError
from fusetune.workers.spec import ArrayOutcome, EpochReport, Joined, MemberReport
from fusetune.workers.untrusted import _Unpickler


class _Name(str):
    """A tenant's str whose unpickling would create a folder, wherever it is decoded."""

    marker = ""

    def __reduce__(self):  # type: ignore[override]
        return (os.makedirs, (self.marker,))


def _decode(value: object) -> object:
    import io

    return _Unpickler(io.BytesIO(pickle.dumps(value, protocol=5))).load()


def test_the_protocols_values_decode_as_they_were_sent() -> None:
    report = EpochReport(array_id=3, members=(MemberReport(trial_id=1, step=0, value=0.5, values=(0.5, 2.0)),),
                         joined=(Joined(trial_id=1),), timings={"train": 1.5}, warnings=("slow",))
    outcome = ArrayOutcome(array_id=3, completed=[1], failed={2: "ValueError: no"}, timings={"train": 2.0})
    plain = ({"node": "host:1", "memory_bytes": 5}, [("sig", None, ["p"], 5)], frozenset({"a"}), b"x", 1.5, None)
    for value in (report, outcome, plain, PackageError("its code failed"), ValueError("no")):
        decoded = _decode(value)
        assert type(decoded) is type(value)
        assert decoded == value or str(decoded) == str(value)


def test_an_object_that_would_run_code_when_decoded_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    name = _Name("workload")
    name.marker = str(tmp_path / "ran")
    with pytest.raises(pickle.UnpicklingError, match="posix.makedirs|os.makedirs"):
        _decode(name)
    with pytest.raises(pickle.UnpicklingError, match="builtins.eval"):
        _decode(type("E", (), {"__reduce__": lambda self: (eval, ("1",))})())
    assert not (tmp_path / "ran").exists()
    # As Ray's error decoding sees it: the cause of a task's error, a class of the tenant's.
    with pytest.raises(pickle.UnpicklingError, match="test_untrusted"):
        _decode(RuntimeError(_Tenants("no")))


class _Tenants(Exception):
    pass


def test_ray_itself_is_left_as_it_is_outside_untrusted_reads(ray_cluster: str) -> None:
    """The guard applies to untrusted.get alone: this process's other ray.get decode as Ray does."""
    from fusetune.workers import untrusted

    ref = ray.put(_Tenants("mine"))
    with pytest.raises(ray.exceptions.RaySystemError):
        untrusted.get(ref, timeout=60)
    assert isinstance(ray.get(ref, timeout=60), _Tenants)
