"""The shape signature and fusion.fuse() apply one rule: equal digests fuse, refusals split.

The service packs trials of equal digest into one array and the worker fuses them; if the
two disagreed, a whole array would fail at fuse().  Both derive from fusion.layout, and
these tests hold them to it on random models as well as on the concrete regressions.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

import fusetune.fusion as fusion
from fusetune.workers.signature import shape_signature

SETTINGS = {"batch_size": 8, "optimizer": "adam", "epochs": 2}


class Scale(nn.Module):
    """A user module configured by plain attributes that its forward reads."""

    def __init__(self, scale: float, op: str) -> None:
        super().__init__()
        self.scale = scale
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale if self.op == "mul" else x + self.scale


def _digest(model: nn.Module) -> str:
    return shape_signature(model, SETTINGS).digest


def _fuses(*models: nn.Module) -> bool:
    try:
        fusion.fuse(models)
    except fusion.FusionError:
        return False
    return True


def _net(*tail: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), *tail)


# --------------------------------------------------------------- concrete regressions


@pytest.mark.parametrize(
    "a,b",
    [
        # The issue: equal signatures, then fuse() refused and the whole array failed.
        (lambda: _net(nn.ReLU(inplace=True)), lambda: _net(nn.ReLU())),
        (lambda: _net(Scale(2.0, "mul")), lambda: _net(Scale(3.0, "mul"))),
        (lambda: _net(Scale(2.0, "mul")), lambda: _net(Scale(2.0, "add"))),
        # Same gap for numeric config the hand-kept attribute list missed: attention and
        # LSTM dropout are one value per fused kernel (their twins hold no per-member p).
        (lambda: nn.Sequential(nn.MultiheadAttention(4, 2, dropout=0.0)),
         lambda: nn.Sequential(nn.MultiheadAttention(4, 2, dropout=0.1))),
        (lambda: nn.Sequential(nn.LSTM(4, 4, num_layers=2, dropout=0.0)),
         lambda: nn.Sequential(nn.LSTM(4, 4, num_layers=2, dropout=0.2))),
        (lambda: _net(nn.Threshold(0.1, 20.0)), lambda: _net(nn.Threshold(0.1, 30.0))),
    ],
    ids=["relu-inplace", "custom-float", "custom-string", "mha-dropout", "lstm-dropout", "threshold-value"],
)
def test_attribute_fuse_refuses_splits_the_signature(a: Any, b: Any) -> None:
    # Members run member 0's module with member 0's attributes, so fusing these would
    # silently change member 1's computation: fuse() refuses, so they must not be packed.
    assert not _fuses(a(), b())
    assert _digest(a()) != _digest(b())


@pytest.mark.parametrize(
    "a,b",
    [
        (lambda: _net(nn.Dropout(0.1)), lambda: _net(nn.Dropout(0.5))),
        (lambda: _net(nn.Dropout2d(0.0)), lambda: _net(nn.Dropout2d(0.3))),
        (lambda: _net(nn.BatchNorm1d(4, momentum=0.1)), lambda: _net(nn.BatchNorm1d(4, momentum=0.3))),
        (lambda: _net(nn.BatchNorm1d(4, momentum=0.1)), lambda: _net(nn.BatchNorm1d(4, momentum=None))),
        # Equal values are equal however they are spelled (and NaN is not refused).
        (lambda: _net(Scale(2, "mul")), lambda: _net(Scale(2.0, "mul"))),
        (lambda: _net(Scale(math.nan, "mul")), lambda: _net(Scale(math.nan, "mul"))),
    ],
    ids=["dropout-p", "dropout2d-p", "bn-momentum", "bn-momentum-none", "int-vs-float", "nan"],
)
def test_attribute_the_engine_keeps_per_member_keeps_the_signature(a: Any, b: Any) -> None:
    assert _digest(a()) == _digest(b())
    assert _fuses(a(), b())


def test_signature_attrs_are_the_engines_layout() -> None:
    # Derived, not copied: the signature's attrs are exactly fusion.layout's config.
    model = _net(nn.ReLU(inplace=True), Scale(2.0, "mul"), nn.Dropout(0.2), nn.BatchNorm1d(4))
    sig = shape_signature(model, SETTINGS)
    assert sig.attrs == tuple((e.path, e.config) for e in fusion.layout(model) if e.config)
    assert sig.layers == tuple((e.path, e.type_name, e.tensors) for e in fusion.layout(model))
    assert dict(sig.attrs)["2"] == (("op", '"mul"'), ("scale", "2"))
    assert dict(dict(sig.attrs)["4"]).keys() == {"affine", "eps", "num_features", "track_running_stats"}


def test_dtype_is_a_signature_only_requirement() -> None:
    # The one deliberate difference, in the safe direction: fuse() would promote mixed
    # dtypes to one, so the scheduler never packs them together.
    a, b = _net(), _net().double()
    assert _fuses(a, b)
    assert _digest(a) != _digest(b)


# --------------------------------------------------------------- property


# One block of a width-w MLP: (kind, options).  Options come from small sets so that a
# redrawn block is often equal to the original, and both sides of the rule are exercised.
_OPTIONS: dict[str, st.SearchStrategy[Any]] = {
    "linear": st.booleans(),  # bias
    "relu": st.booleans(),  # inplace
    "leaky": st.sampled_from([0.01, 0.2]),  # negative_slope
    "dropout": st.sampled_from([0.0, 0.1, 0.5]),  # p: per member
    "bn": st.tuples(st.sampled_from([0.1, 0.3, None]), st.sampled_from([1e-5, 1e-3])),  # momentum, eps
    "ln": st.tuples(st.sampled_from([1e-5, 1e-6]), st.booleans()),  # eps, elementwise_affine
    "gelu": st.sampled_from(["none", "tanh"]),  # approximate
    "scale": st.tuples(st.sampled_from([1, 1.0, 2.0, -0.0, 0.0, math.nan, math.inf]), st.sampled_from(["mul", "add"])),
}
_BLOCKS = st.sampled_from(sorted(_OPTIONS)).flatmap(lambda k: st.tuples(st.just(k), _OPTIONS[k]))


def _block(spec: tuple[str, Any], w: int) -> nn.Module:
    kind, opt = spec
    if kind == "linear":
        return nn.Linear(w, w, bias=opt)
    if kind == "relu":
        return nn.ReLU(inplace=opt)
    if kind == "leaky":
        return nn.LeakyReLU(opt)
    if kind == "dropout":
        return nn.Dropout(opt)
    if kind == "bn":
        return nn.BatchNorm1d(w, momentum=opt[0], eps=opt[1])
    if kind == "ln":
        return nn.LayerNorm(w, eps=opt[0], elementwise_affine=opt[1])
    if kind == "gelu":
        return nn.GELU(approximate=opt)
    return Scale(*opt)


def _model(specs: list[tuple[str, Any]], w: int, dtype: torch.dtype) -> nn.Module:
    return nn.Sequential(nn.Linear(3, w), *(_block(s, w) for s in specs)).to(dtype)


@st.composite
def _pairs(draw: Any) -> tuple[nn.Module, nn.Module]:
    """Two models, the second a random mutation of the first (often none at all)."""
    w = draw(st.integers(2, 3))
    specs = draw(st.lists(_BLOCKS, min_size=0, max_size=4))
    other = []
    for spec in specs:
        if draw(st.booleans()):
            other.append(spec)
        elif draw(st.integers(0, 4)):
            # Redraw the options of the same kind of block (possibly to the same value).
            other.append((spec[0], draw(_OPTIONS[spec[0]])))
        # else: the block is dropped
    if draw(st.integers(0, 5)) == 0:
        other.insert(draw(st.integers(0, len(other))), draw(_BLOCKS))
    w_other = w if draw(st.integers(0, 3)) else draw(st.integers(2, 3))
    dtype_other = torch.float32 if draw(st.integers(0, 5)) else torch.float64
    return _model(specs, w, torch.float32), _model(other, w_other, dtype_other)


@settings(max_examples=150, deadline=None)
@given(pair=_pairs())
def test_equal_signatures_fuse_and_refusals_split(pair: tuple[nn.Module, nn.Module]) -> None:
    a, b = pair
    assert _fuses(a) and _fuses(b)  # each fusible on its own: only their pairing is in question
    same = _digest(a) == _digest(b)
    event("equal signatures" if same else "different signatures")
    for members in ((a, b), (b, a)):
        fuses = _fuses(*members)
        if same:
            assert fuses, "equal signatures, but fuse() refused the members"
        if not fuses:
            assert not same, "fuse() refused members of equal signature"
        # The signature is not stricter than the engine either, except for dtypes.
        if fuses and not same:
            assert [t.dtype for t in a.parameters()] != [t.dtype for t in b.parameters()]
    if same:
        # The packed array really runs: one fused forward of the pair (no backward: a
        # drawn model such as ReLU then ReLU(inplace=True) cannot backpropagate unfused
        # either).
        out = fusion.fuse([a, b])(torch.randn(2, 4, 3))
        assert out.shape[:2] == (2, 4)
