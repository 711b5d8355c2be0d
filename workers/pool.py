"""A pool of Ray worker actors, one per device, as the scheduling loop sees them."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray

from workers.actor import ArrayWorker
from workers.spec import ArrayOutcome, ArraySpec


@dataclass
class WorkerHandle:
    """One worker actor and the array it is training, if any."""

    name: str
    device_type: str
    num_threads: int
    actor: ray.actor.ActorHandle
    node: str = ""
    spec: ArraySpec | None = None
    ref: ray.ObjectRef | None = field(default=None, repr=False)

    @property
    def idle(self) -> bool:
        return self.ref is None


class WorkerPool:
    """Starts one :class:`ArrayWorker` per GPU in the Ray cluster, or CPU workers where there is none.

    Args:
        cpu_workers: how many CPU workers to start when the cluster has no GPU; the cluster's
            CPUs are split evenly between them.
        name_prefix: actor names start with it, so several services can share one cluster.
    """

    def __init__(self, cpu_workers: int = 1, name_prefix: str = "fusetune") -> None:
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        self.workers: list[WorkerHandle] = []
        if gpus:
            slots = [("cuda", 1, {"num_gpus": 1, "num_cpus": 1})] * gpus
        else:
            cpus = max(1, int(resources.get("CPU", 1)) // cpu_workers)
            slots = [("cpu", cpus, {"num_cpus": cpus})] * cpu_workers
        for i, (device_type, threads, options) in enumerate(slots):
            self.workers.append(self._start(f"{name_prefix}-{device_type}-{i}", device_type, threads, options))
        infos = ray.get([w.actor.info.remote() for w in self.workers])
        for worker, info in zip(self.workers, infos, strict=True):
            worker.node = info["node"]

    @staticmethod
    def _start(name: str, device_type: str, threads: int, options: dict) -> WorkerHandle:
        actor = ray.remote(ArrayWorker).options(max_concurrency=1, **options).remote(name, device_type, threads)
        return WorkerHandle(name=name, device_type=device_type, num_threads=threads, actor=actor)

    def idle(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.idle]

    def submit(self, worker: WorkerHandle, spec: ArraySpec) -> None:
        if not worker.idle:
            raise RuntimeError(f"worker {worker.name} is already training array {worker.spec.array_id}")
        worker.spec = spec
        worker.ref = worker.actor.run.remote(spec)

    def poll(self, timeout: float = 0.0) -> list[tuple[WorkerHandle, ArraySpec, ArrayOutcome | BaseException]]:
        """Arrays that finished since the last poll, with their outcome or the error that ended them.

        A worker whose process died is restarted, so the pool keeps its size.
        """
        busy = {w.ref: w for w in self.workers if w.ref is not None}
        if not busy:
            return []
        ready, _ = ray.wait(list(busy), num_returns=len(busy), timeout=timeout)
        finished = []
        for ref in ready:
            worker = busy[ref]
            spec = worker.spec
            try:
                result: ArrayOutcome | BaseException = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                result = exc
                self._restart(worker)
            except ray.exceptions.RayError as exc:
                result = exc
            worker.spec, worker.ref = None, None
            finished.append((worker, spec, result))
        return finished

    def _restart(self, worker: WorkerHandle) -> None:
        options = {"num_gpus": 1, "num_cpus": 1} if worker.device_type == "cuda" else {"num_cpus": worker.num_threads}
        fresh = self._start(worker.name, worker.device_type, worker.num_threads, options)
        worker.actor = fresh.actor

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker.actor)
        self.workers.clear()
