"""A pool of Ray worker actors, one per device, as the scheduling loop sees them."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from fusetune.workers import untrusted
from fusetune.workers.actor import ArrayWorker
from fusetune.workers.package import PackageError
from fusetune.workers.spec import ArrayOutcome, ArraySpec, EpochReply, EpochReport, MemberSpec, TrainingSpec, checked

log = logging.getLogger(__name__)

#: One thing a worker said: an epoch report of the array it trains, or how the array ended
#: (its outcome, or the error that ended it, the worker's death included).
Event = tuple["WorkerHandle", ArraySpec, EpochReport | ArrayOutcome | BaseException]


#: A node declares what kind of device its CPU workers are with a Ray custom resource named
#: by this prefix and the type, e.g. ``ray start --resources '{"fusetune-device:k80": 1}'``:
#: heterogeneous CPU nodes, or a test cluster whose CPU nodes stand for device types.
DEVICE_RESOURCE_PREFIX = "fusetune-device:"


class WorkerHung(RuntimeError):
    """A busy worker answered no heartbeat within the timeout: it was killed."""


class EpochOverran(RuntimeError):
    """An array's epoch ran past the epoch deadline: its worker was killed. The array's own
    doing (its model, data or training code), not the worker's: its members fail, and do not
    resume elsewhere to overrun again."""


def declared_device_type(resources: Mapping[str, float]) -> str | None:
    """The device type a node's Ray resources declare for its CPU workers (see
    :data:`DEVICE_RESOURCE_PREFIX`); None when they declare none (the workers are ``cpu``).

    A node that declares several takes the first in sorted order, with a warning: its CPU
    workers are all of one kind.
    """
    declared = sorted(k[len(DEVICE_RESOURCE_PREFIX):] for k, v in resources.items() if k.startswith(DEVICE_RESOURCE_PREFIX) and v > 0)
    declared = [d for d in declared if d]
    if len(declared) > 1:
        log.warning("a node declares several device types %s for its CPU workers: they are %s", declared, declared[0])
    return declared[0] if declared else None


def _options(backend: str, threads: int) -> dict:
    """Ray resources of one worker: a whole accelerator, or its share of the CPUs."""
    if backend == "cuda":
        return {"num_gpus": 1, "num_cpus": 1}
    if backend == "xla":
        return {"resources": {"TPU": 1}, "num_cpus": 1}
    return {"num_cpus": threads}


@dataclass
class WorkerHandle:
    """One worker actor and the array it is training, if any.

    ``device_type`` is what the scheduler calls the device (its throughput curves are per
    type); ``backend`` is the torch device the actor trains on (``cpu``, ``cuda``, ``xla``).
    They differ only for the CPU workers of a node that declares a device type.
    """

    name: str
    device_type: str
    num_threads: int
    actor: ray.actor.ActorHandle
    node: str = ""  # host:pid of the actor's process
    memory_bytes: int = 16 << 30
    node_id: str = ""  # the Ray node it runs on (it is pinned there)
    spec: ArraySpec | None = None
    stream: ray.ObjectRefGenerator | None = field(default=None, repr=False)  # the array's reports
    ping: tuple[ray.ObjectRef, float] | None = field(default=None, repr=False)  # a heartbeat in flight, sent at
    last_ping: float = 0.0
    hung: bool = False  # killed for answering no heartbeat
    deadline: float | None = None  # monotonic time by which its array's running epoch must report; None: none runs
    set_up: bool = False  # its array's setup is done (its heartbeat said so, or it reported an epoch)
    overran: bool = False  # killed for running an epoch past its deadline
    coming_up: ray.ObjectRef | None = field(default=None, repr=False)  # its first info() call (or its restarted actor's), until it answers
    backend: str = "cpu"
    package: str | None = None  # the code package its actor runs (its runtime_env); None: the service's own code

    @property
    def idle(self) -> bool:
        return self.stream is None


class WorkerPool:
    """Starts one :class:`ArrayWorker` per accelerator in the Ray cluster, or CPU workers where there is none.

    Workers follow the cluster's nodes: each is pinned to a node (Ray's node affinity), a node
    that joins gets workers for its devices at the next :meth:`refresh`, and the workers of a
    node that left are dropped (a busy one when its array's stream reports its death: its
    members resume elsewhere). A worker whose process died on a live node is restarted there.

    Args:
        cpu_workers: how many CPU workers to start when the cluster has no accelerator; the
            cluster's CPUs are split evenly between them (each gets ``CPUs // cpu_workers``
            threads; a node that joins later gets one worker per that many of its CPUs).
            None: one per CPU, one thread each.
        name_prefix: actor names start with it, so several services can share one cluster.
        timeout_s: the longest wait for a call that answers at once (a new worker's info).
        heartbeat_interval_s, heartbeat_timeout_s: busy workers are pinged this often; one
            that answers none for the timeout is hung, and killed (see :meth:`heartbeat`).
        epoch_timeout_s: the longest an array's epoch may run, from its start (the end of the
            array's setup, or the reply to the last epoch's report) to its report or outcome; a
            worker whose epoch runs longer is killed (:meth:`heartbeat`). None: no deadline.
        setup_grace_s: the longest an array's setup may take on top of that, from its submit
            to its first epoch's start: loading its data, building and resuming its models,
            and for a code package's array its runtime env's setup and the package's import.
    """

    def __init__(
        self,
        cpu_workers: int | None = None,
        name_prefix: str = "fusetune",
        timeout_s: float = 60.0,
        heartbeat_interval_s: float = 5.0,
        heartbeat_timeout_s: float = 120.0,
        epoch_timeout_s: float | None = None,
        setup_grace_s: float = 0.0,
    ) -> None:
        self.cpu_workers = cpu_workers
        self.name_prefix = name_prefix
        self.timeout_s = timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.epoch_timeout_s = epoch_timeout_s
        self.setup_grace_s = setup_grace_s
        self.workers: list[WorkerHandle] = []
        self._cpu_threads: int | None = None  # threads of each CPU worker, fixed at the first refresh
        self._index: dict[str, int] = {}  # device type -> the next worker's number
        self._starting: list[WorkerHandle] = []  # started, waiting for their resources
        self._replacing: list[WorkerHandle] = []  # a dead actor's successor, until its process answers (renamed)
        self.refresh()

    def refresh(self) -> list[WorkerHandle]:
        """Follow the cluster's nodes: start workers for the devices of nodes that joined, drop
        the idle workers of nodes that left. Returns the workers started, and those restarted
        in a code package's env whose new process answered since (their ``node`` changed).

        GPUs (Ray resource ``GPU``) get ``cuda`` workers and TPU chips (``TPU``) get ``xla``
        workers; CPU workers are started only while the cluster has no accelerator at all. A
        CPU worker's device type is ``cpu``, or the one its node declares
        (:func:`declared_device_type`).
        """
        nodes = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
        gone = [w for w in [*self.workers, *self._starting, *self._replacing] if w.idle and w.node_id and w.node_id not in nodes]
        for worker in gone:
            log.warning("worker %s left with its node %s", worker.name, worker.node_id[:12])
            self._kill(worker)
        self.workers = [w for w in self.workers if w not in gone]
        self._starting = [w for w in self._starting if w not in gone]
        self._replacing = [w for w in self._replacing if w not in gone]
        accelerators = any(r.get("GPU", 0) >= 1 or r.get("TPU", 0) >= 1 for r in nodes.values())
        slots: list[tuple[str, str, int, str]] = []  # device type, backend, threads, node id
        budget: int | None = None  # CPU workers left to place in the first refresh
        if not accelerators and self._cpu_threads is None:
            total = int(sum(r.get("CPU", 0) for r in nodes.values()))
            if total >= 1:
                self.cpu_workers = budget = self.cpu_workers or total
                self._cpu_threads = max(1, total // self.cpu_workers)
        for node_id, resources in nodes.items():
            mine = [w for w in [*self.workers, *self._starting, *self._replacing] if w.node_id == node_id]
            if accelerators:
                for device_type, resource in (("cuda", "GPU"), ("xla", "TPU")):
                    have = sum(w.backend == device_type for w in mine)
                    slots += [(device_type, device_type, 1, node_id)] * (int(resources.get(resource, 0)) - have)
                continue
            if mine or self._cpu_threads is None or any(w.backend != "cpu" for w in self.workers):
                continue  # a node keeps the CPU workers it got when it joined
            want = int(resources.get("CPU", 0)) // self._cpu_threads
            if budget is not None:  # the first refresh starts cpu_workers workers in all
                want, budget = min(want, budget), budget - min(want, budget)
            declared = declared_device_type(resources) or "cpu"
            slots += [(declared, "cpu", self._cpu_threads, node_id)] * want
        for device_type, backend, threads, node_id in slots:
            index = self._index.get(device_type, 0)
            self._index[device_type] = index + 1
            name = f"{self.name_prefix}-{device_type}-{index}"
            self._starting.append(self._start(name, device_type, threads, node_id, backend))
        # Workers come up once Ray has their resources: the first refresh waits up to
        # timeout_s for them; those still pending (their CPUs are another pool's for now)
        # join at a later refresh, when they have. Each is asked once and its answer awaited
        # across refreshes: a call made anew at each refresh, waited for 0 s, never comes back
        # in time, and the worker never joined.
        for w in self._starting:
            if w.coming_up is None:
                w.coming_up = w.actor.info.remote()
        pending = {w.coming_up: w for w in self._starting}
        wait = self.timeout_s if not self.workers else 0.0
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait) if pending else ([], [])
        started = []
        per_node = {n: sum(w.node_id == n and w.backend == "cpu" for w in [*self.workers, *self._starting, *self._replacing]) for n in nodes}
        for ref in ready:
            worker = pending[ref]
            self._starting.remove(worker)
            worker.coming_up = None
            try:
                self._describe(worker, max(1, per_node.get(worker.node_id, 1)), ref)
            except Exception as exc:  # it died coming up: a later refresh starts another
                log.warning("worker %s did not start: %s", worker.name, exc)
                self._kill(worker)
                continue
            self.workers.append(worker)
            started.append(worker)
        return started + self.renamed()

    def renamed(self) -> list[WorkerHandle]:
        """The workers restarted (in a code package's env by :meth:`submit`, or replacing a dead
        actor: :meth:`_replace`) whose new process has answered since: their ``node`` (its
        host:pid) is the new one's now, and a replacement is in :attr:`workers` again. Waits
        for nothing."""
        asked = {w.coming_up: w for w in [*self.workers, *self._replacing] if w.coming_up is not None}
        answered, _ = ray.wait(list(asked), num_returns=len(asked), timeout=0) if asked else ([], [])
        renamed = []
        for ref in answered:
            worker = asked[ref]
            worker.coming_up = None
            replacement = worker in self._replacing
            try:
                worker.node = untrusted.get(ref, timeout=self.timeout_s)["node"]
            except Exception as exc:  # it did not come up: a busy one's array's stream says why (wait)
                if replacement:  # try again on its node, or drop it with its node
                    log.warning("worker %s did not come up again: %s", worker.name, exc)
                    self._replacing.remove(worker)
                    self._replace(worker)
                continue
            if replacement:
                self._replacing.remove(worker)
                self.workers.append(worker)
            renamed.append(worker)
        return renamed

    def _describe(self, worker: WorkerHandle, sharing: int, info_ref: ray.ObjectRef | None = None) -> None:
        info = untrusted.get(info_ref or worker.actor.info.remote(), timeout=self.timeout_s)
        worker.node, worker.node_id = info["node"], info["node_id"]
        # CPU workers on one node share its memory.
        worker.memory_bytes = int(info["memory_bytes"]) // (sharing if worker.backend == "cpu" else 1)

    @staticmethod
    def _start(
        name: str, device_type: str, threads: int, node_id: str = "", backend: str | None = None,
        package: str | None = None, env: dict[str, Any] | None = None,
    ) -> WorkerHandle:
        """A new actor training on ``backend`` (default: ``device_type``), known to the scheduler
        as ``device_type``; for a code ``package``, in its runtime ``env`` (``workers/package.py``)."""
        backend = backend or device_type
        options = _options(backend, threads)
        if node_id:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        if env is not None:
            options["runtime_env"] = env
        # Ray types .remote() of an actor class as its ActorProxy (the handle or the class
        # itself, for typing method calls); what comes back is the handle.
        actor = cast(ray.actor.ActorHandle, (
            ray.remote(ArrayWorker)
            # run + offer, release, reply, heartbeat; + preload, which may hold the package's
            # import while run waits for it: heartbeats are still answered then.
            .options(max_concurrency=3, **options)
            .remote(name, backend, threads, package)
        ))
        return WorkerHandle(
            name=name, device_type=device_type, num_threads=threads, actor=actor, node_id=node_id, backend=backend, package=package
        )

    @staticmethod
    def _kill(worker: WorkerHandle) -> None:
        try:
            ray.kill(worker.actor, no_restart=True)
        except Exception:  # already gone
            pass

    def idle(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.idle]

    def submit(self, worker: WorkerHandle, spec: ArraySpec, env: dict[str, Any] | None = None) -> None:
        """Start training ``spec`` on the idle ``worker``.

        An array of a code package (``spec.package``) trains in an actor started in that
        package's runtime ``env``: a worker that runs another package (or none) is restarted
        in it first, on its node, and keeps it for the package's later arrays. Ray queues the
        array's call until the new actor is up (its runtime env set up: the package fetched
        and unpacked, its requirements installed); a setup that fails ends the array with a
        :class:`~fusetune.workers.package.PackageError` (:meth:`wait`).
        """
        if not worker.idle:
            assert worker.spec is not None  # submit sets a busy worker's spec with its stream
            raise RuntimeError(f"worker {worker.name} is already training array {worker.spec.array_id}")
        if spec.package != worker.package:
            if spec.package is not None and env is None:
                raise ValueError(f"array {spec.array_id} runs package {spec.package}: its runtime env is needed")
            self._restart(worker, spec.package, env)
        worker.spec = spec
        worker.stream = worker.actor.run.remote(spec)
        worker.ping, worker.last_ping, worker.hung, worker.overran, worker.set_up = None, time.monotonic(), False, False, False
        # Until its heartbeat says the array is set up, the deadline covers the setup too.
        self._arm(worker, self.setup_grace_s)

    def _arm(self, worker: WorkerHandle, grace_s: float = 0.0) -> None:
        """Start the clock of the epoch ``worker`` starts now (see ``epoch_timeout_s``)."""
        if self.epoch_timeout_s is not None:
            worker.deadline = time.monotonic() + self.epoch_timeout_s + grace_s

    def prepare(self, worker: WorkerHandle, package: str, env: dict[str, Any]) -> None:
        """Restart the idle ``worker`` in code ``package``'s runtime ``env`` ahead of the package's
        first array, and have it load the package meanwhile: that array's :meth:`submit` then
        finds the worker up, in the env, with the code imported. (Without this, setting up a new
        package's env happens twice in a row: for its describer, then for the worker.)"""
        if not worker.idle:
            assert worker.spec is not None
            raise RuntimeError(f"worker {worker.name} is training array {worker.spec.array_id}")
        if worker.package != package:
            self._restart(worker, package, env)
            worker.actor.preload.remote()

    def _restart(self, worker: WorkerHandle, package: str | None, env: dict[str, Any] | None) -> None:
        """A new actor for ``worker``, on its node, in ``package``'s runtime ``env`` (None: the
        service's own code). Ray queues calls to it until it is up."""
        self._kill(worker)
        fresh = self._start(worker.name, worker.device_type, worker.num_threads, worker.node_id, worker.backend, package, env)
        worker.actor, worker.package = fresh.actor, package
        worker.coming_up = fresh.actor.info.remote()  # its new process's host:pid, once up (refresh)

    def reply(self, worker: WorkerHandle, reply: EpochReply) -> None:
        """Answer the epoch report of the array ``worker`` is training."""
        if worker.spec is None:
            raise RuntimeError(f"worker {worker.name} is not training an array")
        worker.actor.reply.remote(worker.spec.array_id, reply)
        self._arm(worker)  # its next epoch starts: the time it waited for this reply is not its own

    def offer(self, worker: WorkerHandle, members: list[MemberSpec], after_epoch: int = 0) -> None:
        """Hand newcomers to the array ``worker`` is training; they join at its first epoch
        boundary after ``after_epoch`` epochs of it (0: the next one; ``ArrayWorker.offer``)."""
        if worker.spec is None:
            raise RuntimeError(f"worker {worker.name} is not training an array")
        worker.actor.offer.remote(worker.spec.array_id, members, after_epoch)

    def release(self, worker: WorkerHandle, trial_ids: list[int]) -> None:
        """Ask the array ``worker`` is training to let ``trial_ids`` go at its next epoch boundary."""
        if worker.spec is None:
            raise RuntimeError(f"worker {worker.name} is not training an array")
        worker.actor.release.remote(worker.spec.array_id, trial_ids)

    def heartbeat(self) -> list[WorkerHandle]:
        """Ping the busy workers; kill each that has answered no ping for ``heartbeat_timeout_s``,
        and each whose epoch has run past ``epoch_timeout_s``.

        A ping is served on the actor's second thread, so a worker answers while it trains;
        one that does not (its process is frozen, or stuck holding the interpreter) is hung.
        Its array's stream then reports its death (:meth:`wait`), it is replaced, and its
        members resume from their checkpoints. A worker that answers pings but whose epoch
        never ends (a training loop that never returns) is killed the same way, but its
        stream reports :class:`EpochOverran`: its members fail. An array's first epoch is timed
        from the answer that says its setup is done (or, failing one, from its submit with the
        setup's grace). Returns the workers killed now.
        """
        now = time.monotonic()
        killed = []
        for worker in self.workers:
            if worker.idle or worker.hung or worker.overran:
                continue
            if worker.deadline is not None and now > worker.deadline:
                log.error("worker %s ran an epoch past its deadline (%.0f s): killing it", worker.name, self.epoch_timeout_s or 0)
                worker.overran, worker.ping = True, None
                self._kill(worker)
                killed.append(worker)
                continue
            if worker.ping is not None:
                ref, sent = worker.ping
                ready, _ = ray.wait([ref], timeout=0)
                if ready:
                    worker.ping = None
                    self._note_set_up(worker, ref)
                elif now - sent > self.heartbeat_timeout_s:
                    log.error("worker %s answered no heartbeat in %.0f s: killing it", worker.name, now - sent)
                    worker.hung, worker.ping = True, None
                    self._kill(worker)
                    killed.append(worker)
                    continue
            if worker.ping is None and now - worker.last_ping >= self.heartbeat_interval_s:
                worker.ping, worker.last_ping = (worker.actor.heartbeat.remote(), now), now
        return killed

    def _note_set_up(self, worker: WorkerHandle, answer: ray.ObjectRef) -> None:
        """A heartbeat's answer names the array its worker has set up: its first epoch's
        deadline counts from now, the setup's grace spent or not (once per array: a report
        arms the later epochs')."""
        if worker.set_up or worker.spec is None:
            return
        try:
            array_id = untrusted.get(answer, timeout=self.timeout_s)  # a package's process answers it
        except ray.exceptions.RayError:
            return  # its death comes through its array's stream
        if type(array_id) is int and array_id == worker.spec.array_id:
            worker.set_up = True
            self._arm(worker)

    def wait(self, timeout: float = 0.0) -> list[Event]:
        """What the busy workers said, waiting up to ``timeout`` seconds for the first word.

        Epoch reports leave the worker busy (it waits for :meth:`reply`); an outcome or an
        error makes it idle again. A worker whose process died is restarted on its node, so
        the pool keeps its size; a worker whose node left goes with it.
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
            # What ray.wait gave back are the busy workers' streams, each with its array's spec.
            assert isinstance(stream, ray.ObjectRefGenerator) and spec is not None
            try:
                item: EpochReport | ArrayOutcome | BaseException = untrusted.get(next(stream), timeout=self.timeout_s)
            except StopIteration:  # the stream ended without an outcome: cannot happen in run()
                item = RuntimeError(f"worker {worker.name} ended array {spec.array_id} without an outcome")
            except ray.exceptions.RayActorError as exc:
                item = WorkerHung(f"no heartbeat in {self.heartbeat_timeout_s:.0f} s, killed") if worker.hung else exc
                if worker.overran:
                    item = EpochOverran(
                        f"an epoch ran longer than the epoch timeout ({self.epoch_timeout_s:g} s, "
                        "FUSETUNE_EPOCH_TIMEOUT_S): its worker was killed"
                    )
                self._replace(worker)
            except ray.exceptions.RuntimeEnvSetupError as exc:  # the package's env: its fault, not the worker's
                item = PackageError(f"its runtime environment could not be set up on {worker.node}: {exc}")
                self._replace(worker)
            except ray.exceptions.RayError as exc:
                item = exc
            if isinstance(item, (EpochReport, ArrayOutcome)):
                try:
                    item = checked(item)
                except ValueError as exc:  # what its process sent is not the protocol: that process goes
                    malformed = f"worker {worker.name} sent a malformed message: {exc}"
                    item = PackageError(malformed) if worker.package is not None else RuntimeError(malformed)
                    self._kill(worker)
                    self._replace(worker)
            worker.deadline, worker.set_up = None, True  # until the reply to its report starts the next epoch
            if not isinstance(item, EpochReport):
                worker.spec, worker.stream, worker.ping = None, None, None
            events.append((worker, spec, item))
        return events

    @staticmethod
    def measure_memory(worker: WorkerHandle, workload: str, params: dict[str, Any], training: TrainingSpec) -> ray.ObjectRef:
        """Start measuring, on ``worker``, the memory model of an array of ``params``' class
        (``ArrayWorker.memory_model``) of a registered workload; :meth:`measured` reads it
        without waiting. (A code package's is measured by its describer: ``workers/describer.py``.)"""
        return worker.actor.memory_model.remote(workload, params, training)

    def measured(self, ref: ray.ObjectRef) -> tuple[int, int] | None:
        """A measurement's ``(base, member)`` bytes; None while it runs.

        Raises:
            LookupError: its worker died before it answered (measure again on another).
            RuntimeError: the measurement failed, with its error.
        """
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            base, member = untrusted.get(ref, timeout=self.timeout_s)
        except ray.exceptions.RayActorError as exc:
            raise LookupError(f"its worker died: {exc}") from exc
        except ray.exceptions.RayError as exc:
            raise RuntimeError(str(exc).strip().splitlines()[-1]) from exc
        return int(base), int(member)

    def _replace(self, worker: WorkerHandle) -> None:
        """A new actor for a dead one, on its node; none if the node left. It runs no package:
        the next array of one restarts it in that package's env (:meth:`submit`).

        Nothing waits for the new process (it takes seconds to start): the worker leaves
        :attr:`workers` until it has answered, and :meth:`renamed` brings it back. One that
        never comes up (its node was dying) is started again there, or dropped with its node."""
        self.workers = [w for w in self.workers if w is not worker]
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        if worker.node_id in alive or not worker.node_id:
            self._restart(worker, None, None)
            worker.hung, worker.overran = False, False
            self._replacing.append(worker)
            return
        log.warning("worker %s left with its node %s", worker.name, worker.node_id[:12])

    def shutdown(self) -> None:
        for worker in [*self.workers, *self._starting, *self._replacing]:
            self._kill(worker)
        self.workers.clear()
        self._starting.clear()
        self._replacing.clear()
