"""How many members an array of a class may have on a worker (``Throughput.size_cap``), where no
memory budget is set: the class's memory floor per member, from its model built on the meta
device when its trials were asked, caps it at what the worker's memory holds, less the 20%
headroom that sizing keeps free."""

from __future__ import annotations

from typing import Any

from fusetune.server.loop.throughput import Throughput
from fusetune.server.settings import Settings
from fusetune.workers.pool import WorkerHandle

GIB = 1 << 30


def _throughput() -> Throughput:
    # size_cap without a budget reads only the settings and what was noted: nothing of Ray.
    none: Any = None
    return Throughput(Settings(max_array_size=64), none, none, none)


def _cap(throughput: Throughput, cls: str, worker: WorkerHandle) -> int:
    none: Any = None
    return throughput.size_cap(none, cls, worker, 0, {})


def test_an_array_gets_no_more_members_than_the_worker_holds_at_the_class_floor() -> None:
    throughput = _throughput()
    worker = WorkerHandle("cpu-0", "cpu", 1, actor=None, memory_bytes=10 * GIB)
    assert _cap(throughput, "small", worker) == 64  # nothing known: the setting's cap
    throughput.note_least_bytes("small", 1 << 20)
    assert _cap(throughput, "small", worker) == 64
    throughput.note_least_bytes("big", 3 * GIB)
    assert _cap(throughput, "big", worker) == 2  # 8 GiB of the 10 hold two
    throughput.note_least_bytes("big", 1 * GIB)  # a trial of the class that needs less (no momentum)
    assert _cap(throughput, "big", worker) == 2  # its arrays keep what any member needs for all
    throughput.note_least_bytes("mid", 1 * GIB)
    assert _cap(throughput, "mid", worker) == 8
    # A class over this worker's memory (asking refuses one that no worker holds) gets one
    # member here, never none: a size of 0 means "measuring, start nothing yet".
    throughput.note_least_bytes("bigger", 12 * GIB)
    assert _cap(throughput, "bigger", worker) == 1
