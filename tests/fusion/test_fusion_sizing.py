"""Array sizing: structure, memory cap, caching and the decision rule (never speed)."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys

import pytest
import torch
from torch import nn

import fusetune.fusion as fusion
from fusetune.fusion import sizing


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def test_size_array_structure_and_cache(tmp_path):
    sizing.clear_cache()
    calls = [0]

    def factory():
        calls[0] += 1
        return small_mlp()

    x, y = torch.randn(8, 4, 4), torch.randint(0, 3, (8,))
    path = tmp_path / "sizing.json"
    res = sizing.size_array(factory, x, y, candidates=(1, 2, 4), steps=1, rounds=1, cache_path=path)
    assert res.device_type == "cpu" and res.batch_size == 8
    assert res.member_bytes > 0 and res.max_members == 4
    assert set(res.throughput) == set(res.speedup) == {1, 2, 4}
    assert res.best_members in (1, 2, 4)
    assert res.fusion_pays == (res.best_members > 1)
    # Cached per (signature, device type): no more models are built.
    before = calls[0]
    again = sizing.size_array(factory, x, y, candidates=(1, 2, 4), steps=1, rounds=1)
    assert again is res and calls[0] == before + 1  # only the signature probe
    # And on disk.
    sizing.clear_cache()
    loaded = sizing.size_array(factory, x, y, cache_path=path)
    assert loaded == res
    assert json.loads(path.read_text())


def test_memory_limit_caps_members():
    sizing.clear_cache()
    x, y = torch.randn(8, 4, 4), torch.randint(0, 3, (8,))
    first = sizing.size_array(small_mlp, x, y, candidates=(1, 2), steps=1, rounds=1, cache=False)
    limit = int((first.base_bytes + 2.5 * first.member_bytes) / 0.8)
    capped = sizing.size_array(small_mlp, x, y, candidates=(1, 2, 4, 8), steps=1, rounds=1, cache=False,
                               memory_limit=limit)
    assert capped.max_members == 2 and max(capped.throughput) == 2
    with pytest.raises(fusion.FusionError, match="fits"):
        sizing.size_array(small_mlp, x, y, candidates=(1, 2), steps=1, rounds=1, cache=False, memory_limit=10)


class _Tied(nn.Module):
    """A tied weight (counted once), a frozen parameter and BatchNorm's buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.embed(x)) * self.scale)


@pytest.mark.parametrize(("optimizer", "settings", "kept"), [
    (fusion.optim.SGD, {}, 0), (fusion.optim.SGD, {"momentum": 0.9}, 1),
    (fusion.optim.Adam, {}, 2), (fusion.optim.AdamW, {"amsgrad": True}, 3),
    (fusion.optim.RMSprop, {"momentum": 0.5, "centered": True}, 3), (fusion.optim.Adagrad, {}, 1),
])
def test_a_members_floor_counts_what_training_keeps_without_allocating_it(optimizer, settings, kept):
    trainable = (10 * 4 + 4 + 4) * 4  # the tied weight once, BatchNorm's weight and bias
    frozen, buffers = 4 * 4, (4 + 4) * 4 + 8  # the scale; running mean and var, num_batches_tracked
    sizes = sizing.MemberBytes.of(_Tied())
    assert sizes == sizing.MemberBytes(trainable, frozen + buffers)
    assert sizes.least_to_train(optimizer, settings) == trainable * (2 + kept) + frozen + buffers
    # Shapes only: a 4 TB layer on the meta device costs nothing to count.
    with torch.device("meta"):
        huge = nn.Linear(1_000_000, 1_000_000)
    assert sizing.MemberBytes.of(huge).least_to_train(optimizer, settings) == (10**12 + 10**6) * 4 * (2 + kept)


@pytest.mark.parametrize(("optimizer", "fused"), [("sgd", fusion.optim.SGD), ("adam", fusion.optim.Adam)])
def test_a_members_floor_is_below_the_measured_memory_model(optimizer, fused):
    x, y = torch.randn(8, 4, 4), torch.randint(0, 3, (8,))
    _base, member = sizing.memory_model(small_mlp, x, y, optimizer=optimizer)
    floor = sizing.MemberBytes.of(small_mlp()).least_to_train(fused)
    assert 0 < floor <= member


LINEAR = "torch.nn.modules.linear.Linear"


def test_choose_paths_measures_every_layer_class_with_a_twin():
    x, y = torch.randn(8, 4, 4), torch.randint(0, 3, (8,))
    choice = sizing.choose_paths(small_mlp, x, y, members=2, steps=1, rounds=1)
    assert choice.device_type == "cpu" and choice.members == 2
    assert set(choice.ratios) == {LINEAR} and choice.ratios[LINEAR] > 0
    # min_gain decides: a class goes batched where twin time / batched time reaches it.
    assert choice.batched == ((LINEAR,) if choice.ratios[LINEAR] >= 1.05 else ())
    everything = sizing.choose_paths(small_mlp, x, y, members=2, steps=1, rounds=1, min_gain=0.0)
    assert everything.batched == (LINEAR,) and everything.classes() == {nn.Linear}
    assert sizing.choose_paths(small_mlp, x, y, members=2, steps=1, rounds=1, min_gain=math.inf).classes() == set()


def test_size_array_records_the_chosen_paths(tmp_path):
    sizing.clear_cache()
    x, y = torch.randn(8, 4, 4), torch.randint(0, 3, (8,))
    path = tmp_path / "sizing.json"
    res = sizing.size_array(small_mlp, x, y, candidates=(1, 2), steps=1, rounds=1, cache=False, cache_path=path,
                            choose_paths=True)
    assert set(res.path_ratios) == {LINEAR}
    assert res.batched_layers == ((LINEAR,) if res.path_ratios[LINEAR] >= 1.05 else ())
    assert res.batched_classes() == ({nn.Linear} if res.batched_layers else set())
    loaded = sizing.size_array(small_mlp, x, y, cache_path=path)
    assert loaded == res
    assert sizing.size_array(small_mlp, x, y, candidates=(1, 2), steps=1, rounds=1, cache=False).path_ratios == {}


def test_marginal_cost_fit():
    # speedup(B) = B / (1 + 0.25 (B - 1)) exactly -> c = 0.25
    speedup = {b: b / (1 + 0.25 * (b - 1)) for b in (1, 2, 4, 8)}
    common = dict(signature="sig", device_type="cpu", batch_size=64, base_bytes=0, member_bytes=1,
                  memory_limit=10, max_members=8)
    res = sizing.SizingResult(**common, speedup=speedup, best_members=8, fusion_pays=True)
    assert abs(res.marginal_cost() - 0.25) < 1e-12
    assert sizing.SizingResult(**common).marginal_cost() == 1.0


@pytest.mark.parametrize(
    ("speedup", "expected"),
    [
        ({1: 1.00, 2: 1.30, 4: 1.60}, (4, True)),  # the fastest fused size
        ({1: 0.95, 2: 1.06}, (2, True)),  # B = 1 below 1.0 (wrapper overhead) does not lower the bar
        ({1: 1.00, 2: 1.04}, (1, False)),  # under min_gain: run unfused
        ({1: 1.10, 2: 1.12, 4: 1.08}, (1, False)),  # within the bias B = 1 measured: not a gain
        ({1: 1.10, 2: 1.20}, (2, True)),  # 1.20 >= 1.05 * 1.10
        ({2: 1.20, 4: 1.10}, (2, True)),  # no B = 1 measured: the bar is min_gain
        ({1: 0.90}, (1, False)),  # nothing fused was measured
    ],
)
def test_choose_members_needs_a_gain_beyond_the_measurement_bias(speedup, expected):
    assert sizing.choose_members(speedup, min_gain=1.05) == expected


def test_reuse_cpu_memory_takes_effect_under_glibc():
    # A subprocess: the setting is process-wide and must not leak into the test session.
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("reuse_cpu_memory tunes glibc's malloc; this libc is not glibc")
    out = subprocess.run([sys.executable, "-c", "import fusion; print(fusion.reuse_cpu_memory())"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize(
    ("speedup", "again", "expected"),
    [
        # The pick holds up: it stands, at the lower of its two measurements.
        ({1: 1.0, 2: 1.3, 4: 1.6}, {4: 1.5}, (4, True, {1: 1.0, 2: 1.3, 4: 1.5})),
        # A disturbed measurement made B=2 look fast; measured again it is slower than
        # unfused, and the next pick (measured again too) stands.
        ({1: 1.0, 2: 3.16, 4: 1.3}, {2: 0.94, 4: 1.25}, (4, True, {1: 1.0, 2: 0.94, 4: 1.25})),
        # Nothing holds up: run unfused.
        ({1: 1.0, 2: 1.2}, {2: 1.01}, (1, False, {1: 1.0, 2: 1.01})),
        # A second measurement never raises a speed-up.
        ({1: 1.0, 2: 1.2}, {2: 2.0}, (2, True, {1: 1.0, 2: 1.2})),
    ],
)
def test_the_pick_is_measured_again_before_it_stands(speedup, again, expected):
    measured: list[int] = []

    def measure_again(b: int) -> float:
        measured.append(b)
        return again[b]

    assert sizing.choose_confirmed(speedup, measure_again, min_gain=1.05) == expected
    assert measured == list(again)
