"""The Ray actor that owns one device and trains one array on it at a time."""

from __future__ import annotations

import gc
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch

import fusetune.fusion as fusion
from fusetune.workers.memory import array_memory_model
from fusetune.workers.package import PackageError, package_workload, workload_of
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec, TrainingSpec
from fusetune.workers.training import train_array


class ArrayWorker:
    """Trains arrays on one device: a GPU (``cuda``), a TPU core (``xla``) or the CPU.

    Wrapped with ``ray.remote`` by :class:`workers.pool.WorkerPool`, which gives it the
    device's resources, so Ray places exactly one worker per accelerator. A worker started
    for a tenant's code ``package`` (its digest) runs in that package's ``runtime_env`` and
    trains that package's arrays only (``workers/package.py``).
    """

    def __init__(self, name: str, device_type: str, num_threads: int, package: str | None = None) -> None:
        self.name = name
        self.device_type = device_type
        self.package = package
        if device_type == "cpu":
            # Ray pins OMP threads to the actor's CPUs; torch must agree or it oversubscribes,
            # and never more threads than the node has cores (Ray's CPUs may be logical).
            torch.set_num_threads(max(1, min(num_threads, os.cpu_count() or 1)))
            # Fused activations are B times larger: keep freed memory for the next step
            # instead of page-faulting it back in (before the first dry run or array).
            fusion.reuse_cpu_memory()
        self.device = self._device(device_type)
        self._lock = threading.Lock()
        self._offers: dict[int, list[tuple[int, MemberSpec]]] = {}  # array id -> (after epoch, newcomer)
        self._releases: dict[int, set[int]] = {}
        self._replies: dict[int, queue.SimpleQueue[EpochReply]] = {}
        self._set_up: int | None = None  # the array that trains now, once its setup is done (heartbeat)
        self._settled: set[str] = set()  # workloads whose first array has run here (see run)
        # torch.optim imports torch._dynamo (~1 s on the 2-core machine) when the first
        # optimizer is built: now, not in the build of this worker's first array.
        fusion.import_torch_dynamo()
        # What the process holds by now (torch, Ray, these modules) lives as long as it does:
        # frozen, the collector's full passes stop walking it. Unfrozen, one took ~150 ms on
        # the 2-core machine, every few arrays, stalling whichever array was building.
        gc.freeze()

    @staticmethod
    def _device(device_type: str) -> torch.device:
        if device_type == "xla":
            import torch_xla.core.xla_model as xm  # only present on TPU hosts

            return xm.xla_device()
        return torch.device(device_type)

    def info(self) -> dict[str, str | int]:
        """Where this worker runs and how much device memory it has."""
        if self.device_type == "cuda":
            memory = torch.cuda.get_device_properties(self.device).total_memory
        elif self.device_type == "xla":
            import torch_xla.core.xla_model as xm

            memory = xm.get_memory_info(self.device)["bytes_limit"]
        else:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return {
            "name": self.name,
            "device_type": self.device_type,
            "node": f"{socket.gethostname()}:{os.getpid()}",
            "node_id": ray.get_runtime_context().get_node_id(),
            "memory_bytes": memory,
        }

    def preload(self) -> None:
        """Load this worker's code package now, before its first array (``WorkerPool.prepare``).

        The package's describer loads it at the same time; a package that fails to load fails
        its study there, with the traceback, and its arrays' runs raise the same error again.
        So a failure here is left for them to report and not raised.
        """
        if self.package is None:
            return
        try:
            package_workload(self.package)
        except PackageError:
            pass  # see above: the describer and each array's run say why

    def heartbeat(self) -> int | None:
        """Answered on the actor's second thread while :meth:`run` trains: the process lives.

        Returns the id of the array it trains once that array is set up (its data loaded, its
        models built and resumed; :meth:`built`), None before: the control plane's epoch
        deadline counts from then (``WorkerPool.heartbeat``), not from the array's start.
        """
        with self._lock:
            return self._set_up

    def acknowledged(self, array_id: int, owed: int, timeout_s: float) -> int:
        """How many of the ``owed`` reports of array ``array_id`` the control plane has
        acknowledged, waiting up to ``timeout_s`` for the rest (the training loop asks once
        its last epoch is reported). An array not run through :meth:`run` has no control
        plane to answer: all of them."""
        with self._lock:
            replies = self._replies.get(array_id)
        if replies is None:
            return owed
        # One reply may acknowledge several reports (the control plane batches them): count
        # what the replies acknowledge, not the replies.
        deadline = time.monotonic() + timeout_s
        acked = 0
        while acked < owed:
            try:
                acked += replies.get(timeout=max(0.0, deadline - time.monotonic())).acked
            except queue.Empty:
                break
        return min(acked, owed)

    def built(self, array_id: int) -> None:
        """The training loop's word that array ``array_id`` is set up: its first epoch starts."""
        with self._lock:
            self._set_up = array_id

    def memory_model(self, workload: str, params: dict[str, Any], training: TrainingSpec, package: str | None = None) -> tuple[int, int]:
        """The memory model of an array of ``params``' class, ``(base, member)`` bytes
        (:func:`workers.memory.array_memory_model`), measured in this process: the control
        plane never builds or steps a tenant's model to size its arrays. Asked of an idle
        worker; one that takes an array meanwhile measures on its second thread, on the CPU,
        where what it counts (tensors, not the allocator's peak) is the array's alone.
        """
        if package is not None and package != self.package:
            raise PackageError(f"worker {self.name} runs package {self.package}, not {package}")
        return array_memory_model(workload_of(workload, package), params, training)

    def offer(self, array_id: int, members: list[MemberSpec], after_epoch: int = 0) -> None:
        """Queue newcomers for array ``array_id``: they join it at its first epoch boundary
        after it has trained ``after_epoch`` epochs (0: its next one).

        An offer for a later boundary takes the place of members that end there: the control
        plane offers it one epoch ahead, so that the newcomers join where those members
        leave, and the worker never waits for a scheduling round between them.
        Runs on the actor's second thread while :meth:`run` trains on the first.
        """
        with self._lock:
            self._offers.setdefault(array_id, []).extend((after_epoch, m) for m in members)

    def take(self, array_id: int, epochs_done: int = 0) -> list[MemberSpec]:
        """The newcomers offered to ``array_id`` that may join it at the boundary after its
        epoch ``epochs_done`` (the training loop's inbox); later ones stay queued."""
        with self._lock:
            offers = self._offers.pop(array_id, [])
            now = [m for after, m in offers if after <= epochs_done]
            later = [(after, m) for after, m in offers if after > epochs_done]
            if later:
                self._offers[array_id] = later
            return now

    def release(self, array_id: int, trial_ids: list[int]) -> None:
        """Ask array ``array_id`` to let members ``trial_ids`` go at its next epoch boundary.

        They leave checkpointed and waiting, to resume in whichever array the scheduler
        gives them next (preemption). Runs on the actor's second thread.
        """
        with self._lock:
            self._releases.setdefault(array_id, set()).update(trial_ids)

    def released(self, array_id: int) -> set[int]:
        """The members asked to leave ``array_id`` so far (the training loop's inbox)."""
        with self._lock:
            return self._releases.pop(array_id, set())

    def reply(self, array_id: int, reply: EpochReply) -> None:
        """The control plane's answer to array ``array_id``'s last epoch report (second thread)."""
        with self._lock:
            replies = self._replies.get(array_id)
        if replies is not None:  # else the array has ended: a late answer changes nothing
            replies.put(reply)

    def run(self, spec: ArraySpec) -> Iterator[EpochReport | ArrayOutcome]:
        """Train ``spec``: yields one :class:`EpochReport` per epoch, then the :class:`ArrayOutcome`.

        Called through Ray, this is a streaming generator: the control plane reads each
        report as it is yielded and, when the study has a pruner (``spec.prunes``), answers
        with :meth:`reply`, which the training loop waits for before it acts on the epoch's
        pruning decisions.
        """
        if spec.package != self.package:  # the pool restarts a worker for another package first
            raise PackageError(f"worker {self.name} runs package {self.package}, not {spec.package}")
        with self._lock:
            replies = self._replies.setdefault(spec.array_id, queue.SimpleQueue())
            self._set_up = None
        training = train_array(spec, self.device, inbox=self)
        reply: EpochReply | None = None
        owed = 0  # reports of a pruning study not answered yet
        try:
            while True:
                report = training.send(reply)
                yield report
                if not spec.prunes:
                    # Nothing to decide: a round trip through a busy machine's processes
                    # costs tens of milliseconds, so a study without a pruner never waits;
                    # the replies that arrived meanwhile acknowledge recorded reports.
                    reply = EpochReply(acked=_drain(replies))
                    continue
                reply, owed = _await(replies, owed + 1, spec.reply_timeout_s)
        except StopIteration as stop:
            outcome: ArrayOutcome = stop.value
        with self._lock:
            # Offers that arrived after the last epoch boundary were never trained: the
            # scheduling loop re-queues them when it records this outcome.
            self._offers.pop(spec.array_id, None)
            self._releases.pop(spec.array_id, None)
            self._replies.pop(spec.array_id, None)
            self._set_up = None
        yield outcome
        if spec.workload not in self._settled:
            # A workload's first array imported and cached what its later arrays reuse (its
            # data, its model's code): collected and frozen once, after the outcome is out.
            self._settled.add(spec.workload)
            gc.collect()
            gc.freeze()


def _await(replies: queue.SimpleQueue[EpochReply], owed: int, timeout_s: float) -> tuple[EpochReply, int]:
    """The control plane's answers to the ``owed`` reports not answered yet, merged into one
    reply, and how many are still owed.

    It waits until every owed report is answered or ``timeout_s`` has passed. Past it the
    array goes on as if told to continue: the control plane may be cut off from its
    database (it writes every report once it is back, and answers then), or a client that
    decides pruning may never answer. Trials then neither fail nor hold the device; the
    late answers are taken at a later boundary, their prunes applied there.
    """
    deadline = time.monotonic() + timeout_s
    prune: set[int] = set()
    acked = 0
    while owed:
        try:
            reply = replies.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        prune |= reply.prune
        acked += reply.acked
        owed -= 1
    return EpochReply(prune=frozenset(prune), acked=acked), owed


def _drain(replies: queue.SimpleQueue[EpochReply]) -> int:
    """How many replies wait in ``replies`` (taking them)."""
    count = 0
    while True:
        try:
            count += replies.get_nowait().acked
        except queue.Empty:
            return count
