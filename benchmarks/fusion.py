"""Throughput of fused training vs serial training and a torch.func ensemble.

Prints models·steps/s (B models each doing one training step = B model-steps)
and the ratio to serial training of the same B models, for:

- serial: B ordinary models, each with its own torch.optim.Adam, one after another;
- fused: ``fusion.fuse`` + ``fusion.optim.Adam`` (per-member learning rates);
- func: the torch.func ensemble baseline (``stack_module_state`` +
  ``functional_call`` + ``vmap``) with one torch.optim.Adam over the stacked
  parameters. BatchNorm running statistics are disabled for it
  (``replace_all_batch_norm_modules_``, as torch.func requires), so it does
  slightly less work than the others; ``n/a`` where vmap has no batching rule.

Measurements are pairwise interleaved: each round times every path for the
same number of steps back to back, and each path's best round is reported
(timeit's convention), so load from other jobs on a shared machine, which
only ever slows a round down, disturbs the compared paths alike.

The models people write (``benchmarks/zoo.py``, second half: gpt, vit, sinusoidal,
convnext, rmsnorm, weightnorm, contrastive, einsum) own tensors that have no fused twin
(a position ``nn.Parameter``, a causal-mask buffer, a LayerScale gain, ...); the engine
runs those modules on its batched path (``torch.func.vmap``) with the twins inside fused.
``rcnn8`` and ``rcnn16`` are the residual CNN of ``docs/examples/residual_cnn.py`` at its two
widths, the model ``benchmarks/e2e.py --workload residual-cnn`` sweeps.

Usage: python benchmarks/fusion.py [--models mlp,cnn,resnet,transformer,lstm,pointnet,gpt,vit,...]
       [--members 1,2,4,8,16] [--paths serial,fused,func] [--steps 10]
       [--rounds 5] [--batch 64]
       python benchmarks/fusion.py --profile resnet:4 --steps 2   # where time goes
       python benchmarks/fusion.py --sizing                       # what array sizing picks, and
                                                                  # the pick vs serial
       python benchmarks/fusion.py --sizing --choose-paths        # and twin or batched path per layer
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import pathlib
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Run as a script, this file's directory is sys.path[0] and this very file
# (benchmarks/fusion.py) would shadow the fusion package; import the package
# from the repository root instead.
_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fusion  # noqa: E402
from benchmarks.zoo import (  # noqa: E402
    GPT,
    LSTMLM,
    ContrastiveDualEncoder,
    ConvNeXt,
    EinsumTransformer,
    PointNet,
    ResNet18,
    RMSNormMLP,
    SinusoidalTransformer,
    TransformerClassifier,
    ViT,
    WeightNormTCN,
    cnn,
    contrastive_loss,
    lm_loss,
    mlp,
)

# ----------------------------------------------------------------------------- workloads
# The models are defined once, in benchmarks/zoo.py (the fusion tests use the same classes).


Inputs = tuple[torch.Tensor, ...]


@dataclass
class Workload:
    factory: Callable[[], nn.Module]
    #: batch size -> (the model's inputs, the loss target)
    make_batch: Callable[[int], tuple[Inputs, torch.Tensor]]
    loss: Callable[..., torch.Tensor] = F.cross_entropy


def _tokens(n: int, seq: int = 32, vocab: int = 1000) -> torch.Tensor:
    x = torch.randint(1, vocab, (n, seq))
    x[: n // 2, seq * 3 // 4 :] = 0  # half the batch padded
    return x


def _example(name: str) -> Any:
    """A program of docs/examples, loaded by path (it is not a package), once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE.parent / "docs" / "examples" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _residual_cnn(width: int) -> nn.Module:
    """The user's residual CNN of docs/examples/residual_cnn.py (what benchmarks/e2e.py sweeps)."""
    model: nn.Module = _example("residual_cnn").ResidualCNN(width)
    return model


def _labels(n: int) -> torch.Tensor:
    return torch.randint(0, 10, (n,))


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload(mlp, lambda n: ((torch.randn(n, 1, 8, 8),), _labels(n))),
    "cnn": Workload(cnn, lambda n: ((torch.randn(n, 1, 8, 8),), _labels(n))),
    "resnet": Workload(ResNet18, lambda n: ((torch.randn(n, 3, 32, 32),), _labels(n))),
    "transformer": Workload(TransformerClassifier, lambda n: ((_tokens(n),), _labels(n))),
    "lstm": Workload(LSTMLM, lambda n: ((torch.randint(0, 1000, (n, 32)),), torch.randint(0, 1000, (n, 32)))),
    "pointnet": Workload(PointNet, lambda n: ((torch.randn(n, 3, 256),), _labels(n))),
    # Models people write (the batched path runs their modules without a twin).
    "gpt": Workload(GPT, lambda n: ((torch.randint(0, 128, (n, 16)),), torch.randint(0, 128, (n, 16))), lm_loss),
    "vit": Workload(ViT, lambda n: ((torch.randn(n, 3, 16, 16),), _labels(n))),
    "sinusoidal": Workload(SinusoidalTransformer, lambda n: ((torch.randint(0, 128, (n, 16)),), _labels(n))),
    "convnext": Workload(ConvNeXt, lambda n: ((torch.randn(n, 3, 16, 16),), _labels(n))),
    "rmsnorm": Workload(RMSNormMLP, lambda n: ((torch.randint(0, 128, (n, 16)),), _labels(n))),
    "weightnorm": Workload(WeightNormTCN, lambda n: ((torch.randn(n, 4, 32),), _labels(n))),
    "contrastive": Workload(ContrastiveDualEncoder,
                            lambda n: ((torch.randn(n, 48), torch.randint(0, 128, (n, 8))), torch.arange(n)),
                            contrastive_loss),
    "einsum": Workload(EinsumTransformer, lambda n: ((torch.randint(0, 128, (n, 16)),), _labels(n))),
    # docs/examples/residual_cnn.py's model at its two widths (the e2e sweep's two classes).
    "rcnn8": Workload(lambda: _residual_cnn(8), lambda n: ((torch.randn(n, 3, 32, 32),), _labels(n))),
    "rcnn16": Workload(lambda: _residual_cnn(16), lambda n: ((torch.randn(n, 3, 32, 32),), _labels(n))),
}

# ----------------------------------------------------------------------------- paths

Step = Callable[[], None]


def serial_step(models: list[nn.Module], x: Inputs, y: torch.Tensor, loss: Callable[..., torch.Tensor]) -> Step:
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3 * (i + 1)) for i, m in enumerate(models)]

    def step() -> None:
        for m, o in zip(models, opts):
            o.zero_grad(set_to_none=True)
            loss(m(*x), y).backward()
            o.step()

    return step


def fused_step(models: list[nn.Module], x: Inputs, y: torch.Tensor, loss: Callable[..., torch.Tensor]) -> Step:
    fused = fusion.fuse(models)
    b = len(models)
    opt = fusion.optim.Adam(fused.parameters(), lr=[1e-3 * (i + 1) for i in range(b)])
    xb, yb = [fusion.broadcast(t, b) for t in x], fusion.broadcast(y, b)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        fusion.per_member_loss(loss, fused(*xb), yb).sum().backward()
        opt.step()

    return step


def func_step(models: list[nn.Module], x: Inputs, y: torch.Tensor, loss: Callable[..., torch.Tensor]) -> Step | None:
    from torch.func import functional_call, stack_module_state, vmap

    models = [copy.deepcopy(m) for m in models]
    for m in models:
        torch.func.replace_all_batch_norm_modules_(m)
    params, buffers = stack_module_state(models)
    # A plain copy, not a meta one: functional_call must find tied parameters tied.
    base = copy.deepcopy(models[0])
    opt = torch.optim.Adam(list(params.values()), lr=1e-3)

    def one(p: dict, bufs: dict, xi: Inputs, yi: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(base, (p, bufs), xi), yi)

    loss_fn = vmap(one, in_dims=(0, 0, None, None), randomness="different")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(params, buffers, x, y).sum().backward()
        opt.step()

    try:
        step()
    except Exception:
        return None
    return step


PATHS = {"serial": serial_step, "fused": fused_step, "func": func_step}

# ----------------------------------------------------------------------------- driver


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, b: int, batch: int, steps: int, rounds: int,
            paths: list[str], device: torch.device = torch.device("cpu")) -> dict[str, tuple[float | None, float | None]]:
    """Per path: (models·steps/s, ratio to serial), from the best of interleaved rounds."""
    work = WORKLOADS[name]
    torch.manual_seed(0)
    inputs, target = work.make_batch(batch)
    x, y = tuple(t.to(device) for t in inputs), target.to(device)
    models = [work.factory().to(device) for _ in range(b)]
    runners: dict[str, Step | None] = {}
    for p in paths:
        runners[p] = PATHS[p]([copy.deepcopy(m) for m in models], x, y, work.loss)
        if runners[p] is not None:
            for _ in range(2):
                runners[p]()  # warm-up (and the fused model's dry run)
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(rounds):
        for p in paths:  # interleaved: every path once per round, back to back
            run = runners[p]
            if run is None:
                continue
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                run()
            _sync(device)
            times[p].append(time.perf_counter() - start)
    out: dict[str, tuple[float | None, float | None]] = {}
    for p, t in times.items():
        if not t:
            out[p] = (None, None)
            continue
        # Best of the interleaved rounds (timeit's convention): on a machine
        # shared with other jobs, the fastest round is the one least disturbed,
        # and interleaving gives every path the same chances of such a round.
        rate = b * steps / min(t)
        ratio = min(times["serial"]) / min(t) if times.get("serial") else None
        out[p] = (rate, ratio)
    return out


def profile(name: str, b: int, batch: int, steps: int) -> None:
    """Per-operator CPU time of serial vs fused training steps (where the time goes)."""
    work = WORKLOADS[name]
    torch.manual_seed(0)
    x, y = work.make_batch(batch)
    models = [work.factory() for _ in range(b)]
    for label, make in (("serial", serial_step), ("fused", fused_step)):
        run = make([copy.deepcopy(m) for m in models], x, y, work.loss)
        for _ in range(2):
            run()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                run()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        print(f"\n{label}: {name}, B={b}, {total / steps / 1e3:.1f} ms of CPU time per step")
        for e in events[:12]:
            share = 100 * e.self_cpu_time_total / total
            print(f"  {e.key:<48}{e.self_cpu_time_total / steps / 1e3:>9.2f} ms{share:>7.1f}%{e.count // steps:>7} calls")


def sizing_report(names: list[str], members: list[int], batch: int, steps: int, rounds: int,
                  check_steps: int, check_rounds: int, device: torch.device, choose_paths: bool = False) -> None:
    """What ``fusion.sizing.size_array`` picks per model, and how fast the pick runs.

    The pick is then measured the way the table is (``measure``: serial vs fused,
    pairwise-interleaved, best round) in the same process, as a worker that sized an
    array goes on to train it. An unfused pick (B=1) runs the members as ordinary
    models, i.e. at serial speed by definition.
    """
    from fusetune.fusion import sizing

    print(f"{'model':<12}{'max B':>6}{'best B':>7}{'fusion pays':>12}{'pick x serial':>15}   speedup vs unfused by B")
    for name in names:
        work = WORKLOADS[name]
        torch.manual_seed(0)
        x, y = work.make_batch(batch)
        if len(x) != 1:
            print(f"{name:<12}   (size_array takes one input tensor; this model takes {len(x)})", flush=True)
            continue
        res = sizing.size_array(work.factory, x[0], y, device=device, loss_fn=work.loss, candidates=members,
                                steps=steps, rounds=rounds, cache=False, choose_paths=choose_paths)
        curve = "  ".join(f"{b}:{res.speedup[b]:.2f}x" for b in sorted(res.speedup))
        if res.fusion_pays:
            ratio = measure(name, res.best_members, batch, check_steps, check_rounds, ["serial", "fused"],
                            device)["fused"][1]
            pick = f"{ratio:.2f}x"
        else:
            pick = "1.00x (unf.)"
        print(f"{name:<12}{res.max_members:>6}{res.best_members:>7}{str(res.fusion_pays):>12}{pick:>15}   {curve}",
              flush=True)
        if choose_paths:
            ratios = "  ".join(f"{k.rsplit('.', 1)[-1]}:{v:.2f}" for k, v in res.path_ratios.items())
            print(f"{'':<12}paths at B={res.max_members} (twin time / batched time): {ratios}; "
                  f"batched: {[k.rsplit('.', 1)[-1] for k in res.batched_layers] or 'none'}", flush=True)


def where(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(WORKLOADS))
    parser.add_argument("--members", default="1,2,4,8,16")
    parser.add_argument("--paths", default="serial,fused,func")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--device", default="cpu", help="torch device to train on (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--glibc-malloc-defaults", action="store_true",
                        help="leave glibc's malloc as it is instead of fusion.reuse_cpu_memory(), "
                             "which the CPU workers call")
    parser.add_argument("--profile", default="", metavar="MODEL:B",
                        help="print a per-operator profile of serial vs fused instead of the table")
    parser.add_argument("--sizing", action="store_true",
                        help="print what fusion.sizing picks per model, and the pick's speed against "
                             "serial (--steps x --rounds), instead of the table")
    parser.add_argument("--choose-paths", action="store_true",
                        help="with --sizing: also pick twin or batched path per layer class (size_array's "
                             "choose_paths) and print the measured ratios")
    parser.add_argument("--sizing-steps", type=int, default=2, help="size_array's steps (its default)")
    parser.add_argument("--sizing-rounds", type=int, default=5, help="size_array's rounds (its default)")
    args = parser.parse_args()
    # vmap's fallback for CPU flash attention warns on every call; the table says "func" is slow there.
    warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    malloc = "glibc defaults" if args.glibc_malloc_defaults or not fusion.reuse_cpu_memory() else "reuse_cpu_memory"
    if args.sizing:
        print(f"torch {torch.__version__}, {where(device)}, batch {args.batch}, malloc: {malloc}; "
              f"pick x serial: {args.steps} steps x {args.rounds} interleaved rounds (best round)")
        sizing_report(args.models.split(","), [int(v) for v in args.members.split(",")], args.batch,
                      args.sizing_steps, args.sizing_rounds, args.steps, args.rounds, device, args.choose_paths)
        return
    if args.profile:
        name, b = args.profile.split(":")
        profile(name, int(b), args.batch, args.steps)
        return
    paths = args.paths.split(",")
    print(f"torch {torch.__version__}, {where(device)}, batch {args.batch}, "
          f"{args.steps} steps x {args.rounds} interleaved rounds (best round), malloc: {malloc}")
    header = f"{'model':<12}{'B':>3}" + "".join(f"{p + ' m·s/s':>16}{'x serial':>10}" for p in paths)
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        for b in (int(v) for v in args.members.split(",")):
            res = measure(name, b, args.batch, args.steps, args.rounds, paths, device)
            row = f"{name:<12}{b:>3}"
            for p in paths:
                v, r = res[p]
                row += f"{(f'{v:.1f}' if v else 'n/a'):>16}{(f'{r:.2f}x' if r else 'n/a'):>10}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
