"""A pool of Ray worker actors, one per device, as the scheduling loop sees them."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from fusetune.workers.actor import ArrayWorker
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec

#: One thing a worker said: an epoch report of the array it trains, or how the array ended
#: (its outcome, or the error that ended it, the worker's death included).
Event = tuple["WorkerHandle", ArraySpec, EpochReport | ArrayOutcome | BaseException]


def _options(device_type: str, threads: int) -> dict:
    """Ray resources of one worker: a whole accelerator, or its share of the CPUs."""
    if device_type == "cuda":
        return {"num_gpus": 1, "num_cpus": 1}
    if device_type == "xla":
        return {"resources": {"TPU": 1}, "num_cpus": 1}
    return {"num_cpus": threads}


@dataclass
class WorkerHandle:
    """One worker actor and the array it is training, if any."""

    name: str
    device_type: str
    num_threads: int
    actor: ray.actor.ActorHandle
    node: str = ""
    memory_bytes: int = 16 << 30
    spec: ArraySpec | None = None
    stream: ray.ObjectRefGenerator | None = field(default=None, repr=False)  # the array's reports

    @property
    def idle(self) -> bool:
        return self.stream is None


class WorkerPool:
    """Starts one :class:`ArrayWorker` per accelerator in the Ray cluster, or CPU workers where there is none.

    Args:
        cpu_workers: how many CPU workers to start when the cluster has no accelerator; the
            cluster's CPUs are split evenly between them. None: one per CPU, one thread each.
        name_prefix: actor names start with it, so several services can share one cluster.
    """

    def __init__(self, cpu_workers: int | None = None, name_prefix: str = "fusetune") -> None:
        self.cpu_workers = cpu_workers
        self.name_prefix = name_prefix
        self.workers: list[WorkerHandle] = []
        self.refresh()

    def refresh(self) -> list[WorkerHandle]:
        """Start a worker for every accelerator that joined the cluster since the last call.

        GPUs (Ray resource ``GPU``) get ``cuda`` workers and TPU chips (``TPU``) get ``xla``
        workers; CPU workers are started only while the cluster has no accelerator at all.
        Returns the workers started.
        """
        resources = ray.cluster_resources()
        slots: list[tuple[str, int]] = []
        for device_type, resource in (("cuda", "GPU"), ("xla", "TPU")):
            have = sum(w.device_type == device_type for w in self.workers)
            slots += [(device_type, 1)] * (int(resources.get(resource, 0)) - have)
        if not slots and not self.workers and resources.get("CPU", 0) >= 1:
            self.cpu_workers = self.cpu_workers or int(resources["CPU"])
            slots = [("cpu", max(1, int(resources["CPU"]) // self.cpu_workers))] * self.cpu_workers
        started = []
        for device_type, threads in slots:
            index = sum(w.device_type == device_type for w in self.workers)
            worker = self._start(f"{self.name_prefix}-{device_type}-{index}", device_type, threads)
            self.workers.append(worker)
            started.append(worker)
        infos = ray.get([w.actor.info.remote() for w in started])
        for worker, info in zip(started, infos, strict=True):
            worker.node = info["node"]
            # CPU workers on one node share its memory.
            worker.memory_bytes = int(info["memory_bytes"]) // ((self.cpu_workers or 1) if worker.device_type == "cpu" else 1)
        return started

    @staticmethod
    def _start(name: str, device_type: str, threads: int) -> WorkerHandle:
        actor = (
            ray.remote(ArrayWorker)
            .options(max_concurrency=2, **_options(device_type, threads))  # run + offer
            .remote(name, device_type, threads)
        )
        return WorkerHandle(name=name, device_type=device_type, num_threads=threads, actor=actor)

    def idle(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.idle]

    def submit(self, worker: WorkerHandle, spec: ArraySpec) -> None:
        if not worker.idle:
            raise RuntimeError(f"worker {worker.name} is already training array {worker.spec.array_id}")
        worker.spec = spec
        worker.stream = worker.actor.run.remote(spec)

    def reply(self, worker: WorkerHandle, reply: EpochReply) -> None:
        """Answer the epoch report of the array ``worker`` is training."""
        if worker.spec is None:
            raise RuntimeError(f"worker {worker.name} is not training an array")
        worker.actor.reply.remote(worker.spec.array_id, reply)

    def offer(self, worker: WorkerHandle, members: list[MemberSpec]) -> None:
        """Hand newcomers to the array ``worker`` is training; they join at its next epoch boundary."""
        if worker.spec is None:
            raise RuntimeError(f"worker {worker.name} is not training an array")
        worker.actor.offer.remote(worker.spec.array_id, members)

    def release(self, worker: WorkerHandle, trial_ids: list[int]) -> None:
        """Ask the array ``worker`` is training to let ``trial_ids`` go at its next epoch boundary."""
        if worker.spec is None:
            raise RuntimeError(f"worker {worker.name} is not training an array")
        worker.actor.release.remote(worker.spec.array_id, trial_ids)

    def wait(self, timeout: float = 0.0) -> list[Event]:
        """What the busy workers said, waiting up to ``timeout`` seconds for the first word.

        Epoch reports leave the worker busy (it waits for :meth:`reply`); an outcome or an
        error makes it idle again. A worker whose process died is restarted, so the pool
        keeps its size.
        """
        busy = {w.stream: w for w in self.workers if w.stream is not None}
        if not busy:
            return []
        ready, rest = ray.wait(list(busy), num_returns=1, timeout=timeout)
        if ready and rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        events: list[Event] = []
        for stream in ready:
            worker = busy[stream]
            spec = worker.spec
            try:
                item: EpochReport | ArrayOutcome | BaseException = ray.get(next(stream))
            except StopIteration:  # the stream ended without an outcome: cannot happen in run()
                item = RuntimeError(f"worker {worker.name} ended array {spec.array_id} without an outcome")
            except ray.exceptions.RayActorError as exc:
                item = exc
                worker.actor = self._start(worker.name, worker.device_type, worker.num_threads).actor
                worker.node = ray.get(worker.actor.info.remote())["node"]
            except ray.exceptions.RayError as exc:
                item = exc
            if not isinstance(item, EpochReport):
                worker.spec, worker.stream = None, None
            events.append((worker, spec, item))
        return events

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker.actor)
        self.workers.clear()
