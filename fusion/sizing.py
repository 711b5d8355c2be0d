"""Array sizing: how many members to fuse on a device, from dry runs.

``size_array`` answers two questions for one model signature on one device
type and caches the answer per (signature, device type):

1. The largest B that fits. A memory model ``bytes(B) = base + B * member``
   is fitted from dry runs at B = 1 and 2 (CUDA: the allocator's peak; CPU:
   parameters, gradients, optimizer state and the tensors autograd saves for
   backward) and the largest candidate under the limit minus headroom is then
   checked by a real training step (on CUDA an out-of-memory steps B down).
2. The B with the highest speed-up among those that fit: each B is timed
   interleaved with an ordinary unfused model over ``rounds`` rounds (a block of
   n fused steps lasting at least ``min_block_seconds``, then a block of n * B
   unfused steps: the same work), so load from other jobs hits both alike, and
   the speed-up is the median of the rounds' ratios. The fastest B is measured once more
   and counts at the lower of its two speed-ups (:func:`choose_confirmed`). If no fused B
   beats the unfused model by ``min_gain`` (times B = 1's measured ratio when above 1: the
   bias of the measurement itself, since a one-member array runs the ordinary model),
   ``fusion_pays`` is False and ``best_members`` is 1: the scheduler should run members
   unfused (or in parallel) on that device.

With ``choose_paths=True`` it first answers a third (:func:`choose_paths`): for each
layer class of the model that has a fused twin, whether the twin or the batched path
(``torch.func.vmap`` over the plain layer) trains the largest fitting array faster on this
device; the classes the batched path wins are recorded (``batched_layers``) and the
speed-ups are measured with them. On the CPUs measured so far the twins win.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from . import optim as fused_optim
from ._errors import FusionError
from ._functional import broadcast, per_member_loss
from ._model import FusedModel, fuse
from .nn import TWINS

OptimizerName = str

#: The fraction of a device's memory that sizing keeps free by default: what the process, the
#: data and allocator fragmentation take beyond what a memory model counts.
HEADROOM = 0.2

_TORCH_OPT = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
_FUSED_OPT = {"sgd": fused_optim.SGD, "adam": fused_optim.Adam, "adamw": fused_optim.AdamW}


@dataclass(frozen=True)
class SizingResult:
    """Outcome of :func:`size_array` for one (signature, device type)."""

    signature: str
    device_type: str
    batch_size: int
    #: Memory model, bytes(B) = base_bytes + B * member_bytes.
    base_bytes: int
    member_bytes: int
    #: Bytes B may use: the device's available memory minus headroom.
    memory_limit: int
    #: Largest candidate B that fits.
    max_members: int
    #: Measured fused models·steps/s per B (B members each doing a step = B).
    throughput: dict[int, float] = field(default_factory=dict)
    #: models·steps/s of one ordinary, unfused model.
    solo_steps_per_s: float = 0.0
    #: Fused / unfused throughput per B (best interleaved round of each).
    speedup: dict[int, float] = field(default_factory=dict)
    #: B to run: the fastest fitting B, or 1 (unfused) when fusion does not pay.
    best_members: int = 1
    #: Whether some fused B beats the unfused model on this device.
    fusion_pays: bool = False
    #: Layer classes (``module.qualname``) that run on the batched path on this device
    #: (``choose_paths=True``; see :class:`PathChoice`), and every class's measured ratio.
    batched_layers: tuple[str, ...] = ()
    path_ratios: dict[str, float] = field(default_factory=dict)

    def batched_classes(self) -> frozenset[type[nn.Module]]:
        """``batched_layers`` as classes, for ``fusion.fuse(models, batched=...)``."""
        return _classes_named(self.batched_layers)

    def marginal_cost(self) -> float:
        """Fraction of a solo step one extra member adds, fitted to the measurements.

        Model: ``speedup(B) = B / (1 + c (B - 1))`` (the scheduler's
        ``SpeedupCurve``); least squares over the measured B > 1 of
        ``B / speedup(B) - 1 = c (B - 1)``. 1.0 (no gain) without measurements.
        """
        points = [(b, s) for b, s in self.speedup.items() if b > 1 and s > 0]
        if not points:
            return 1.0
        num = sum((b - 1) * (b / s - 1) for b, s in points)
        den = sum((b - 1) ** 2 for b, _ in points)
        return min(1.0, max(0.0, num / den))

    def to_json(self) -> dict[str, Any]:
        """JSON-friendly form (dict keys as strings)."""
        out = asdict(self)
        out["throughput"] = {str(k): v for k, v in self.throughput.items()}
        out["speedup"] = {str(k): v for k, v in self.speedup.items()}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SizingResult:
        data = dict(data)
        data["throughput"] = {int(k): float(v) for k, v in data["throughput"].items()}
        data["speedup"] = {int(k): float(v) for k, v in data["speedup"].items()}
        data["batched_layers"] = tuple(data.get("batched_layers", ()))
        return cls(**data)


_CACHE: dict[tuple[str, str], SizingResult] = {}


def clear_cache() -> None:
    """Forget every cached sizing result (in memory)."""
    _CACHE.clear()


def model_signature(model: nn.Module, example_input: torch.Tensor, optimizer: str, batch_size: int) -> str:
    """Hash of what decides speed and memory: class, parameter shapes, input, optimizer."""
    parts = [type(model).__module__ + "." + type(model).__qualname__, optimizer, str(batch_size),
             str(tuple(example_input.shape[1:])), str(example_input.dtype)]
    parts += [f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in model.state_dict().items()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class _Array:
    """A fused array of B fresh members with its optimizer and a training step."""

    def __init__(self, factory: Callable[[], nn.Module], b: int, device: torch.device, optimizer: str,
                 lr: float, x: Any, y: Any, loss_fn: Callable[..., torch.Tensor],
                 batched: frozenset[type[nn.Module]] = frozenset()) -> None:
        self.fused: FusedModel = fuse([factory() for _ in range(b)], batched=batched).to(device)
        self.opt = _FUSED_OPT[optimizer](self.fused.parameters(), lr=lr)
        self.x, self.y = broadcast(x, b), broadcast(y, b)
        self.loss_fn = loss_fn

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        per_member_loss(self.loss_fn, self.fused(self.x), self.y).sum().backward()
        self.opt.step()

    def state_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors: list[torch.Tensor] = list(self.fused.parameters()) + list(self.fused.buffers())
        tensors += [p.grad for p in self.fused.parameters() if p.grad is not None]
        for state in self.opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def saved_activation_bytes(self) -> int:
        """Bytes of the tensors autograd keeps for backward during one forward."""
        seen: set[int] = set()
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total[0] += t.untyped_storage().nbytes()
            return t

        self.opt.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = per_member_loss(self.loss_fn, self.fused(self.x), self.y).sum()
        loss.backward()
        return total[0]


@dataclass(frozen=True)
class MemberBytes:
    """What one member's tensors take, grouped by how training multiplies them.

    Only shapes and dtypes are read (:meth:`of`), so the model may live on the meta device: a
    model too large for any device is found without allocating it.
    """

    #: Parameters that train: each gets a gradient and the optimizer's state.
    trainable: int
    #: Frozen parameters and buffers.
    fixed: int

    @classmethod
    def of(cls, model: nn.Module) -> MemberBytes:
        params = list(model.parameters())  # a tied weight once, as it trains
        return cls(
            trainable=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
            fixed=sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
            + sum(b.numel() * b.element_size() for b in model.buffers()),
        )

    def least_to_train(self, optimizer: type[fused_optim.FusedOptimizer],
                       settings: Mapping[str, Any] = MappingProxyType({})) -> int:
        """A floor of the bytes the member needs to train with ``optimizer`` and its ``settings``
        (torch's argument names): its tensors, the gradients and the optimizer's state
        (``FusedOptimizer.state_tensors``); the activations of a step come on top, and an
        array of B such members needs at least B times this."""
        return self.trainable * (2 + optimizer.state_tensors(settings)) + self.fixed


def _measure_bytes(array: _Array, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        array.step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before + array.state_bytes())
    array.step()
    return array.state_bytes() + array.saved_activation_bytes()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_model(
    model_factory: Callable[[], nn.Module],
    example_input: Any,
    example_target: Any,
    *,
    device: str | torch.device = "cpu",
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    optimizer: OptimizerName = "adam",
    lr: float = 1e-3,
) -> tuple[int, int]:
    """The memory model of an array of ``model_factory()`` members: ``(base, member)`` bytes,
    bytes(B) = base + B * member, fitted from one training step of fused arrays at B = 1 and 2
    (CUDA: the allocator's peak; CPU: parameters, gradients, optimizer state and the tensors
    autograd saves for backward). :func:`size_array` sizes arrays with it; the service caps
    arrays by it when workers have a memory budget (``FUSETUNE_WORKER_MEMORY_BYTES``).

    ``example_input`` is the model's one positional argument and ``example_target`` the
    loss's second: tensors ``[N, ...]``, or tuples, lists or dicts of them (a batch as a
    ``DataLoader`` collates it, for a model that takes the batch), broadcast to every member.
    """
    dev = torch.device(device)
    if optimizer not in _FUSED_OPT:
        raise FusionError(f"optimizer must be one of {sorted(_FUSED_OPT)}, got {optimizer!r}")
    x, y = pytree.tree_map_only(torch.Tensor, lambda t: t.to(dev), (example_input, example_target))
    sizes = []
    for b in (1, 2):
        array = _Array(model_factory, b, dev, optimizer, lr, x, y, loss_fn)
        sizes.append(_measure_bytes(array, dev))
        del array
    member = max(sizes[1] - sizes[0], 1)
    return max(sizes[0] - member, 0), member


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _classes_named(names: Sequence[str]) -> frozenset[type[nn.Module]]:
    return frozenset(c for c in TWINS if _class_name(c) in names)


@dataclass(frozen=True)
class PathChoice:
    """Which path runs each layer class of a model that has a fused twin, on one device type.

    ``ratios[name]`` is the array's step time with the class's twins over its step time
    with that class on the batched path (median of interleaved rounds; above 1: the
    batched path is faster); ``batched`` names the classes whose ratio reached ``min_gain``.
    """

    device_type: str
    members: int
    ratios: dict[str, float]
    batched: tuple[str, ...]

    def classes(self) -> frozenset[type[nn.Module]]:
        """The ``batched`` classes, for ``fusion.fuse(models, batched=...)``."""
        return _classes_named(self.batched)


def _timed(fn: Callable[[], None], n: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return time.perf_counter() - start


def choose_paths(
    model_factory: Callable[[], nn.Module],
    example_input: torch.Tensor,
    example_target: torch.Tensor,
    *,
    device: str | torch.device = "cpu",
    members: int = 8,
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    optimizer: OptimizerName = "adam",
    lr: float = 1e-3,
    steps: int = 2,
    rounds: int = 5,
    min_gain: float = 1.05,
) -> PathChoice:
    """Time an array of ``members`` with all twins against the same array with one layer
    class on the batched path, for every class of the model that has a twin.

    Blocks of ``steps`` steps of the two arrays alternate in order over ``rounds`` rounds, so
    load from other jobs hits both alike; a class goes batched where the median ratio
    reaches ``min_gain``.
    """
    dev = torch.device(device)
    x, y = example_input.to(dev), example_target.to(dev)
    present = list(dict.fromkeys(type(m) for m in model_factory().modules() if type(m) in TWINS))
    twins = _Array(model_factory, members, dev, optimizer, lr, x, y, loss_fn)
    twins.step()  # warm-up and dry run
    ratios: dict[str, float] = {}
    for cls in present:
        other = _Array(model_factory, members, dev, optimizer, lr, x, y, loss_fn, frozenset({cls}))
        other.step()
        pairs = []
        for r in range(rounds):
            first, second = (twins, other) if r % 2 else (other, twins)
            t1, t2 = _timed(first.step, steps, dev), _timed(second.step, steps, dev)
            pairs.append((t1, t2) if first is twins else (t2, t1))
        ratios[_class_name(cls)] = statistics.median(t / b for t, b in pairs)
        del other
    chosen = tuple(name for name, ratio in ratios.items() if ratio >= min_gain)
    return PathChoice(device_type=dev.type, members=members, ratios=ratios, batched=chosen)


def _race(step: Callable[[], None], solo_step: Callable[[], None], b: int, n: int, rounds: int,
          device: torch.device) -> tuple[list[float], list[float]]:
    """Per round, the seconds of a fused step and of an unfused one, from blocks of equal work.

    Equal work per block: n fused steps against n * b unfused steps (the b members trained
    one after another). A block of only n unfused steps would be short next to the fused one,
    and its first steps after a large fused block (cold caches, pages the allocator just
    returned) would make fusion look better. The order alternates so that neither path
    always runs right after the other.
    """
    fused_t, solo_t = [], []
    for r in range(rounds):
        if r % 2:
            fused_t.append(_timed(step, n, device) / n)
        solo_t.append(_timed(solo_step, n * b, device) / (n * b))
        if not r % 2:
            fused_t.append(_timed(step, n, device) / n)
    return fused_t, solo_t


def choose_confirmed(speedup: dict[int, float], measure_again: Callable[[int], float],
                     min_gain: float) -> tuple[int, bool, dict[int, float]]:
    """:func:`choose_members`, with the pick measured once more before it stands.

    Other jobs that slow the unfused blocks of one size's rounds make that size look faster
    than it is (on the shared 2-vCPU VM a B=2 measured 3.16x and then ran at 0.94x). The
    pick's speed-up is measured again (``measure_again(B)``) and counts at the lower of its
    two measurements; if that no longer passes, the next pick is measured, and so on.
    Returns the B to run, whether fusion pays, and the speed-ups as they then count.
    """
    speedup = dict(speedup)
    confirmed: set[int] = set()
    while True:
        best, pays = choose_members(speedup, min_gain)
        if not pays or best in confirmed:
            return best, pays, speedup
        speedup[best] = min(speedup[best], measure_again(best))
        confirmed.add(best)


def choose_members(speedup: dict[int, float], min_gain: float) -> tuple[int, bool]:
    """The B to run from measured speed-ups (fused / unfused by B): (B, fusion pays).

    A B = 1 array runs the ordinary model through the fused wrapper, so its true
    speed-up is 1.0 and its measured one is the measurement's own bias (order, cache and
    allocator effects, load). The fastest fused size must beat that bias (when above
    1.0) by ``min_gain``; otherwise members run unfused: (1, False).
    """
    null = max(1.0, speedup.get(1, 1.0))
    best = max((b for b in speedup if b > 1), key=lambda b: speedup[b], default=1)
    if best > 1 and speedup[best] >= min_gain * null:
        return best, True
    return 1, False


def size_array(
    model_factory: Callable[[], nn.Module],
    example_input: torch.Tensor,
    example_target: torch.Tensor,
    *,
    device: str | torch.device = "cpu",
    loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
    optimizer: OptimizerName = "adam",
    lr: float = 1e-3,
    candidates: Sequence[int] = (1, 2, 4, 8, 16),
    memory_limit: int | None = None,
    headroom: float = HEADROOM,
    steps: int = 2,
    rounds: int = 5,
    min_gain: float = 1.05,
    min_block_seconds: float = 0.05,
    signature: str | None = None,
    cache: bool = True,
    cache_path: str | os.PathLike[str] | None = None,
    choose_paths: bool = False,
) -> SizingResult:
    """Size a fused array of ``model_factory()`` models for one device type.

    ``example_input``/``example_target`` are one batch ``[N, ...]`` (shared by
    all members during the dry runs). ``memory_limit`` overrides the bytes
    available on the device (default: free CUDA memory, or MemAvailable on
    CPU); ``headroom`` is the fraction of it kept free. Results are cached in
    memory per (signature, device type), and in ``cache_path`` (JSON) if given.
    ``choose_paths``: first pick twin or batched path per layer class at the largest
    fitting B (:func:`choose_paths`), and measure every B with that choice.
    """
    dev = torch.device(device)
    if optimizer not in _FUSED_OPT:
        raise FusionError(f"optimizer must be one of {sorted(_FUSED_OPT)}, got {optimizer!r}")
    cands = sorted({int(c) for c in candidates if int(c) >= 1})
    if not cands:
        raise FusionError("candidates must contain at least one B >= 1")
    probe_model = model_factory()
    sig = signature or model_signature(probe_model, example_input, optimizer, example_input.shape[0])
    cached, file_cache = _cached(sig, dev, cache, cache_path)
    if cached is not None:
        return cached
    x, y = example_input.to(dev), example_target.to(dev)
    base, member, limit, fitting = _fitting(model_factory, x, y, dev, loss_fn, optimizer, lr, cands, memory_limit,
                                            headroom)
    max_members = fitting[-1]
    paths = (_choose_paths(model_factory, x, y, device=dev, members=max_members, loss_fn=loss_fn,
                           optimizer=optimizer, lr=lr, steps=steps, rounds=rounds, min_gain=min_gain)
             if choose_paths else PathChoice(dev.type, max_members, {}, ()))
    race = _Race(model_factory, probe_model, dev, optimizer, lr, x, y, loss_fn, paths.classes(),
                 steps, rounds, min_block_seconds)
    throughput: dict[int, float] = {}
    speedup: dict[int, float] = {}
    solo_times: list[float] = []
    for b in fitting:
        fused_t, solo_t = race.run(b)
        solo_times += solo_t
        # Throughput: best round (timeit's convention: other jobs only ever slow a round
        # down). Speed-up: the median of the interleaved rounds' ratios, so that one lucky
        # round cannot make a fused size look better than it is.
        throughput[b] = b / min(fused_t)
        speedup[b] = statistics.median(b * s / f for s, f in zip(solo_t, fused_t))
    best, pays, speedup = choose_confirmed(speedup, race.speedup, min_gain)
    result = SizingResult(
        signature=sig, device_type=dev.type, batch_size=int(example_input.shape[0]),
        base_bytes=int(base), member_bytes=int(member), memory_limit=limit, max_members=max_members,
        throughput=throughput, solo_steps_per_s=1.0 / min(solo_times), speedup=speedup,
        best_members=best, fusion_pays=pays, batched_layers=paths.batched, path_ratios=dict(paths.ratios),
    )
    if cache:
        _CACHE[(sig, dev.type)] = result
    if cache_path is not None:
        file_cache[f"{sig}@{dev.type}"] = result.to_json()
        Path(cache_path).write_text(json.dumps(file_cache, indent=1, sort_keys=True))
    return result


def _cached(sig: str, dev: torch.device, cache: bool,
            cache_path: str | os.PathLike[str] | None) -> tuple[SizingResult | None, dict[str, Any]]:
    """A cached result for (signature, device type), if any, and the cache file's contents."""
    file_cache: dict[str, Any] = {}
    if cache_path is not None and Path(cache_path).exists():
        file_cache = json.loads(Path(cache_path).read_text())
    key = (sig, dev.type)
    if cache and key in _CACHE:
        return _CACHE[key], file_cache
    if cache and f"{sig}@{dev.type}" in file_cache:
        _CACHE[key] = SizingResult.from_json(file_cache[f"{sig}@{dev.type}"])
        return _CACHE[key], file_cache
    return None, file_cache


def _fitting(model_factory: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, dev: torch.device,
             loss_fn: Callable[..., torch.Tensor], optimizer: str, lr: float, cands: list[int],
             memory_limit: int | None, headroom: float) -> tuple[int, int, int, list[int]]:
    """The memory model, the byte limit, and the candidate sizes that fit (base, member, limit, sizes)."""
    base, member = memory_model(model_factory, x, y, device=dev, loss_fn=loss_fn, optimizer=optimizer, lr=lr)
    available = memory_limit if memory_limit is not None else _available_bytes(dev)
    limit = int(available * (1.0 - headroom))
    fitting = [b for b in cands if base + b * member <= limit]
    if not fitting:
        raise FusionError(
            f"not even B={cands[0]} fits: needs ~{base + cands[0] * member} bytes, {limit} available"
        )
    # Check the model by a real step at the largest size (CUDA: step down on OOM).
    while fitting:
        try:
            _Array(model_factory, fitting[-1], dev, optimizer, lr, x, y, loss_fn).step()
            break
        except torch.cuda.OutOfMemoryError:
            fitting.pop()
            torch.cuda.empty_cache()
    if not fitting:
        raise FusionError("no candidate size survived a real training step")
    return base, member, limit, fitting


class _Race:
    """Fused arrays of each size timed against one ordinary unfused model, interleaved."""

    def __init__(self, model_factory: Callable[[], nn.Module], probe_model: nn.Module, dev: torch.device,
                 optimizer: str, lr: float, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                 batched: frozenset[type[nn.Module]], steps: int, rounds: int, min_block_seconds: float) -> None:
        self.factory, self.dev, self.optimizer, self.lr = model_factory, dev, optimizer, lr
        self.x, self.y, self.loss_fn, self.batched = x, y, loss_fn, batched
        self.steps, self.rounds, self.min_block_seconds = steps, rounds, min_block_seconds
        self.solo = copy.deepcopy(probe_model).to(dev)
        self.solo_opt = _TORCH_OPT[optimizer](self.solo.parameters(), lr=lr)
        self.blocks: dict[int, int] = {}
        self.solo_step()

    def solo_step(self) -> None:
        self.solo_opt.zero_grad(set_to_none=True)
        self.loss_fn(self.solo(self.x), self.y).backward()
        self.solo_opt.step()

    def run(self, b: int) -> tuple[list[float], list[float]]:
        """Seconds per fused step and per unfused step of each round, for a fresh array of ``b``."""
        array = _Array(self.factory, b, self.dev, self.optimizer, self.lr, self.x, self.y, self.loss_fn, self.batched)
        array.step()  # warm-up and dry run
        # A timed block of a few-millisecond model is mostly timer and scheduler noise;
        # run each block for at least min_block_seconds so noise cannot pass min_gain.
        one = max(_timed(array.step, 1, self.dev), 1e-6)
        n = self.blocks.setdefault(b, max(self.steps, math.ceil(self.min_block_seconds / one)))
        return _race(array.step, self.solo_step, b, n, self.rounds, self.dev)

    def speedup(self, b: int) -> float:
        """The median over rounds of the unfused time of b steps over the fused step time."""
        fused_t, solo_t = self.run(b)
        return statistics.median(b * s / f for s, f in zip(solo_t, fused_t))


# size_array's keyword argument of that name hides the function inside it.
_choose_paths = choose_paths
