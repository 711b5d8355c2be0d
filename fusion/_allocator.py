"""CPU memory allocator settings for fused training."""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["reuse_cpu_memory"]

# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_NEVER_TRIM = 1 << 30  # an int: mallopt takes one; 1 GiB of free heap top is kept


def reuse_cpu_memory() -> bool:
    """Make glibc's malloc keep freed CPU memory for reuse instead of returning it to the OS.

    A fused array's activations are B times one model's. glibc serves blocks above its
    mmap threshold (which never exceeds 32 MiB) from fresh ``mmap`` pages and trims freed
    heap back to the OS, so a fused step over such tensors pays page faults for them on
    every step, while B unfused models, each with B times smaller tensors, reuse heap
    memory. Measured on a 2-core CPU, an LSTM language model fused at B = 16 ran at 0.55x
    serial with glibc's defaults and 1.10x with this setting (docs/benchmarks.md). This is
    what jemalloc or tcmalloc would do; the cost is that the process keeps its peak heap.

    Process-wide; call it once, early, in a process that trains on the CPU (the workers
    do). Returns True if the settings took effect, False where malloc is not glibc's.
    """
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    libc = ctypes.CDLL(path)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    # Every block from the heap (no mmap), and freed heap never trimmed back.
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
