"""Time and profile the fused training step of the service's digits workloads.

The step is the hot loop of ``workers.training.train_array``::

    out = fused(fusion.broadcast(x[idx], B))
    losses = fusion.per_member_loss(F.cross_entropy, out, fusion.broadcast(y[idx], B))
    optimizer.zero_grad(set_to_none=True); losses.sum().backward(); optimizer.step()

with models from ``workers.workloads.get_workload(...).build_model(params)`` and the
optimizer the worker trains them with (``workers.optimization``: fusion.optim.SGD with
per-member lr/momentum/weight_decay for digits-mlp, fusion.optim.Adam for digits-cnn). The baseline
is the same B models trained one after another as ordinary torch models with
``torch.optim`` (torch's defaults), on the same batches.

Models·steps/s = B / (seconds per step). Rounds are interleaved (each round times fused
and serial back to back) and the median over rounds is reported, with the min-max spread.
Seconds are the training thread's CPU time by default (``--clock cpu``: with one torch
thread all the work runs on the calling thread, and time spent descheduled on a shared
machine does not count); ``--clock wall`` times wall-clock seconds instead.
Runs with 1 torch thread and ``fusion.reuse_cpu_memory()``, as the service's CPU workers do
(``--glibc-malloc-defaults`` leaves malloc alone).

Usage:
    python benchmarks/step_profile.py                        # table, mlp32/mlp64/cnn, B 1..64
    python benchmarks/step_profile.py --models mlp64 --members 8,32 --rounds 9
    python benchmarks/step_profile.py --eval                 # also the per-epoch eval pass
    python benchmarks/step_profile.py --profile mlp64:32     # torch.profiler + cProfile of the fused step
    python benchmarks/step_profile.py --baseline /tmp/base   # also an older fusion, same process
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# Run as a script, sys.path[0] is benchmarks/, whose fusion.py would shadow the package.
_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

import fusion  # noqa: E402
from fusetune.workers.optimization import optimizer_kwargs, optimizer_name, resolve  # noqa: E402
from fusetune.workers.workloads import get_workload  # noqa: E402

#: Benchmark name -> (workload, build params shared by all members).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp32": ("digits-mlp", {"hidden": 32}),
    "mlp64": ("digits-mlp", {"hidden": 64}),
    "cnn": ("digits-cnn", {"channels": 16}),
}

def member_params(workload_name: str, shape: dict[str, Any], b: int) -> list[dict[str, Any]]:
    """B trials' params: distinct per-member hyper-parameters, as a study would suggest."""
    out = []
    for i in range(b):
        p = dict(shape)
        if workload_name == "digits-mlp":
            # As digits-mlp's search space draws them: every value differs, momentum is never 0.
            p.update(lr=0.01 + 0.002 * i, momentum=0.5 + 0.4 * i / b, weight_decay=1e-4 * (1 + i / b))
        else:
            p.update(lr=1e-3 * (1 + 0.1 * i), weight_decay=1e-5 * (i % 2))
        out.append(p)
    return out


def torch_optimizer(workload_name: str, model: torch.nn.Module, p: dict[str, Any]) -> torch.optim.Optimizer:
    return resolve(get_workload(workload_name), None, p).torch_optimizer(model.parameters())


def load_baseline(path: str) -> Any:
    """Import the ``fusion`` package in folder ``path`` (another checkout) as ``fusion_baseline``."""
    import importlib.util

    folder = pathlib.Path(path, "fusion") if pathlib.Path(path, "fusion").is_dir() else pathlib.Path(path)
    init = folder / "__init__.py"
    spec = importlib.util.spec_from_file_location("fusion_baseline", init, submodule_search_locations=[str(folder)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fusion_baseline"] = module
    spec.loader.exec_module(module)
    return module


class Fused:
    """One fused training path: a fused model and optimizer from the ``fusion`` module ``fz``."""

    def __init__(self, fz: Any, models: list[torch.nn.Module], workload: Any, params: list[dict[str, Any]]) -> None:
        self.fz, self.workload, self.b = fz, workload, len(models)
        self.model = fz.fuse(models)
        cls = getattr(fz.optim, optimizer_name(workload.optimizer))
        self.optimizer = cls(self.model.parameters(), **optimizer_kwargs(workload, params))
        self.model.train()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        fz, b = self.fz, self.b
        out = self.model(fz.broadcast(x, b))
        losses = fz.per_member_loss(self.workload.loss, out, fz.broadcast(y, b))
        self.optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        self.optimizer.step()

    def eval(self, x_val: torch.Tensor, y_val: torch.Tensor) -> None:
        self.model.eval()
        with torch.no_grad():
            out = self.model(self.fz.broadcast(x_val, self.b))
        [self.workload.metric(out[i], y_val) for i in range(self.b)]
        self.model.train()


class Setup:
    """Data and the training paths for one (model, B)."""

    def __init__(self, name: str, b: int, batch: int, seed: int = 0, baseline: Any = None) -> None:
        wname, shape = MODELS[name]
        self.workload = wl = get_workload(wname)
        self.b = b
        train, val = wl.datasets()
        self.x, self.y = train.tensors
        self.x_val, self.y_val = val.tensors
        self.batch = batch
        params = member_params(wname, shape, b)
        self.paths: dict[str, Fused] = {}
        for label, fz in (("fused", fusion), ("baseline", baseline)):
            if fz is not None:
                torch.manual_seed(seed)
                self.paths[label] = Fused(fz, [wl.build_model(p) for p in params], wl, params)
        torch.manual_seed(seed)
        self.serial_models = [wl.build_model(p) for p in params]
        self.serial_opts = [torch_optimizer(wname, m, p) for m, p in zip(self.serial_models, params)]
        self.generator = torch.Generator().manual_seed(seed)
        for m in self.serial_models:
            m.train()

    def next_idx(self) -> torch.Tensor:
        return torch.randint(0, len(self.y), (self.batch,), generator=self.generator)

    def step(self, path: str, idx: torch.Tensor) -> None:
        if path == "serial":
            self.serial_step(idx)
        else:
            self.paths[path].step(self.x[idx], self.y[idx])

    def eval(self, path: str) -> None:
        if path == "serial":
            self.serial_eval()
        else:
            self.paths[path].eval(self.x_val, self.y_val)

    def serial_step(self, idx: torch.Tensor) -> None:
        xb, yb, loss = self.x[idx], self.y[idx], self.workload.loss
        for m, o in zip(self.serial_models, self.serial_opts):
            o.zero_grad(set_to_none=True)
            loss(m(xb), yb).backward()
            o.step()

    def serial_eval(self) -> None:
        for m in self.serial_models:
            m.eval()
            with torch.no_grad():
                self.workload.metric(m(self.x_val), self.y_val)
            m.train()


CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}


def measure(name: str, b: int, batch: int, steps: int, rounds: int, with_eval: bool,
            clock: Callable[[], float] = time.thread_time, baseline: Any = None) -> dict[str, list[float]]:
    """Per path, seconds per step of each round (and of the eval pass, under ``<path>_eval``)."""
    s = Setup(name, b, batch, baseline=baseline)
    paths = [*s.paths, "serial"]
    idxs = [s.next_idx() for _ in range(steps)]
    for path in paths:  # warm-up (and the fused model's dry run)
        for idx in idxs[:3]:
            s.step(path, idx)
        s.eval(path)
    res: dict[str, list[float]] = {k: [] for p in paths for k in (p, p + "_eval")}
    for _ in range(rounds):
        for path in paths:  # interleaved: every path once per round, back to back
            start = clock()
            for idx in idxs:
                s.step(path, idx)
            res[path].append((clock() - start) / steps)
            if with_eval:
                start = clock()
                s.eval(path)
                res[path + "_eval"].append(clock() - start)
    return res


def profile(name: str, b: int, batch: int, steps: int, top: int) -> None:
    s = Setup(name, b, batch)
    idxs = [s.next_idx() for _ in range(steps)]
    for path in ("fused", "serial"):
        for idx in idxs[:3]:
            s.step(path, idx)
    for label in ("fused", "serial"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for idx in idxs:
                s.step(label, idx)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\n[torch.profiler] {label}: {name}, B={b}: {total / steps / 1e3:.3f} ms of op self-time per step")
        print(f"  {'op':<44}{'ms/step':>9}{'share':>8}{'calls/step':>12}")
        for e in events[:top]:
            print(f"  {e.key[:44]:<44}{e.self_cpu_time_total / steps / 1e3:>9.3f}"
                  f"{100 * e.self_cpu_time_total / total:>7.1f}%{e.count / steps:>12.1f}")
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for idx in idxs:
        s.step("fused", idx)
    prof.disable()
    wall = (time.perf_counter() - start) / steps
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    print(f"\n[cProfile] fused step {name}, B={b}: {wall * 1e3:.3f} ms/step under cProfile; "
          f"{stats.total_calls / steps:.0f} Python calls/step")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(top)
    print("\n".join(buf.getvalue().splitlines()[6:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp32,mlp64,cnn")
    parser.add_argument("--members", default="1,8,16,32,64")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: the thread's CPU time (robust on a shared machine); wall: wall-clock")
    parser.add_argument("--eval", action="store_true", help="also time the per-epoch eval pass")
    parser.add_argument("--profile", default="", metavar="MODEL:B", help="profile instead of the table")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--baseline", default="", metavar="DIR",
                        help="a checkout (or its fusion/ folder) whose fusion package is timed alongside, "
                             "e.g. from `git worktree add /tmp/base HEAD~3`")
    parser.add_argument("--glibc-malloc-defaults", action="store_true",
                        help="do not call fusion.reuse_cpu_memory() (the CPU workers call it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    malloc = "glibc defaults" if args.glibc_malloc_defaults or not fusion.reuse_cpu_memory() else "reuse_cpu_memory"
    if args.profile:
        name, b = args.profile.split(":")
        profile(name, int(b), args.batch, args.steps, args.top)
        return
    baseline = load_baseline(args.baseline) if args.baseline else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch {args.batch}, "
          f"{args.steps} steps x {args.rounds} interleaved rounds, median [min-max], {args.clock} clock, "
          f"malloc: {malloc}" + (f", baseline: {args.baseline}" if baseline else ""))
    cols = ["fused"] + (["baseline"] if baseline else []) + ["serial"]
    head = f"{'model':<7}{'B':>4}" + "".join(f"{c + ' m·s/s':>22}" for c in cols) + f"{'fused/serial':>14}"
    if baseline:
        head += f"{'fused/base':>12}"
    if args.eval:
        head += "   eval ms " + "/".join(cols)
    print(head)
    print("-" * len(head))
    for name in args.models.split(","):
        for b in (int(v) for v in args.members.split(",")):
            r = measure(name, b, args.batch, args.steps, args.rounds, args.eval, CLOCKS[args.clock], baseline)
            row = f"{name:<7}{b:>4}"
            for c in cols:
                rates = [b / t for t in r[c]]
                row += f"{statistics.median(rates):>9.0f} [{min(rates):>5.0f}-{max(rates):>5.0f}]"
            # Ratios per round (both timed back to back), then the median.
            row += f"{statistics.median(st / ft for ft, st in zip(r['fused'], r['serial'])):>13.2f}x"
            if baseline:
                row += f"{statistics.median(bt / ft for ft, bt in zip(r['fused'], r['baseline'])):>11.2f}x"
            if args.eval:
                row += "   " + "/".join(f"{statistics.median(r[c + '_eval']) * 1e3:.2f}" for c in cols)
            print(row, flush=True)


if __name__ == "__main__":
    main()
