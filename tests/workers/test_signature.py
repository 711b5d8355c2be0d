"""Tests for shape signatures and derived fusibility."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from fusetune.workers.signature import Signature, fusible_params, shape_signature


def _mlp(hidden: int, depth: int = 2) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(16, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, 4))
    return nn.Sequential(*layers)


def _meta(factory: Any, *args: Any) -> nn.Module:
    with torch.device("meta"):
        return factory(*args)


BASE_SETTINGS = {"batch_size": 32, "optimizer": "adam", "epochs": 5}


def test_equal_models_and_settings_give_equal_digest() -> None:
    a = shape_signature(_mlp(64), BASE_SETTINGS)
    b = shape_signature(_mlp(64), dict(reversed(list(BASE_SETTINGS.items()))))
    assert isinstance(a, Signature)
    assert a == b
    assert a.digest == b.digest
    assert len(a.digest) == 16 and int(a.digest, 16) >= 0


def test_digest_is_pinned_and_canonical() -> None:
    # The digest is a pure function of the canonical form: pin it so that a change to the
    # canonical form (which would split arrays across a service upgrade) is a deliberate,
    # visible decision.  32 and 32.0 are the same batch size.  Re-pinned (was
    # 0eafa15d603be9d4) when the signature started hashing fusion.layout's attributes
    # (here Linear's in_features/out_features) instead of a hand-kept list.
    sig = shape_signature(nn.Linear(3, 2), {"batch_size": 8})
    assert sig.digest == "bc47f337a776c990"
    assert sig.attrs == (("", (("in_features", "3"), ("out_features", "2"))),)
    assert shape_signature(nn.Linear(3, 2), {"batch_size": 8.0}).digest == sig.digest


def test_hidden_width_changes_digest() -> None:
    assert shape_signature(_mlp(64), BASE_SETTINGS).digest != shape_signature(_mlp(128), BASE_SETTINGS).digest


def test_depth_changes_digest() -> None:
    assert shape_signature(_mlp(64, 2), BASE_SETTINGS).digest != shape_signature(_mlp(64, 3), BASE_SETTINGS).digest


def test_lr_only_difference_keeps_digest() -> None:
    # lr is a per-member value in HFTA's fused optimizers: it is not an array-wide setting,
    # and it does not change any shape, so the trials fuse.
    def build(params: Mapping[str, Any]) -> nn.Module:
        torch.manual_seed(int(params["lr"] * 1e6))
        return _meta(_mlp, params["hidden"])

    a = shape_signature(build({"lr": 1e-3, "hidden": 64}), BASE_SETTINGS)
    b = shape_signature(build({"lr": 3e-2, "hidden": 64}), BASE_SETTINGS)
    assert a.digest == b.digest


@pytest.mark.parametrize(
    "key,value",
    [("batch_size", 64), ("optimizer", "sgd"), ("epochs", 6), ("amp", True)],
)
def test_array_wide_setting_changes_digest(key: str, value: Any) -> None:
    changed = dict(BASE_SETTINGS, **{key: value})
    assert shape_signature(_mlp(64), BASE_SETTINGS).digest != shape_signature(_mlp(64), changed).digest


def test_optimizer_class_setting_canonicalised_by_name() -> None:
    a = shape_signature(_mlp(8), {"optimizer": torch.optim.Adam})
    b = shape_signature(_mlp(8), {"optimizer": torch.optim.Adam})
    c = shape_signature(_mlp(8), {"optimizer": torch.optim.SGD})
    assert a.digest == b.digest != c.digest
    assert "torch.optim.adam.Adam" in a.settings[0][1]


def test_meta_device_matches_cpu_model() -> None:
    meta = _meta(_mlp, 64)
    assert next(meta.parameters()).is_meta
    assert shape_signature(meta, BASE_SETTINGS).digest == shape_signature(_mlp(64), BASE_SETTINGS).digest


def test_layers_record_types_and_shapes_in_module_order() -> None:
    sig = shape_signature(_meta(_mlp, 8, 1), {})
    paths = [p for p, _, _ in sig.layers]
    assert paths == ["", "0", "1", "2"]
    assert sig.layers[1][1] == "torch.nn.modules.linear.Linear"
    assert sig.layers[1][2] == (("weight", (8, 16)), ("bias", (8,)))
    assert sig.layers[2][2] == ()
    assert sig.settings == ()


def test_buffers_and_dtypes_are_part_of_signature() -> None:
    bn = shape_signature(_meta(nn.BatchNorm1d, 8), {})
    names = [n for n, _ in bn.layers[0][2]]
    assert names[:2] == ["weight", "bias"] and "running_mean" in names
    half = nn.Linear(4, 4).to(torch.float16)
    assert shape_signature(half, {}).digest != shape_signature(nn.Linear(4, 4), {}).digest
    assert ("weight", "torch.float16") in shape_signature(half, {}).dtypes


def test_structural_attributes_split_equal_shapes() -> None:
    # Same weight shapes, different stride: a different kernel, cannot share an operator.
    s1 = shape_signature(_meta(nn.Conv2d, 3, 8, 3), {})
    s2 = shape_signature(nn.Conv2d(3, 8, 3, stride=2, device="meta"), {})
    assert s1.layers == s2.layers
    assert s1.digest != s2.digest
    assert shape_signature(nn.MaxPool2d(2), {}).digest != shape_signature(nn.MaxPool2d(3), {}).digest


def test_operator_type_changes_digest() -> None:
    assert shape_signature(nn.ReLU(), {}).digest != shape_signature(nn.GELU(), {}).digest


def test_lazy_module_rejected_with_clear_error() -> None:
    with pytest.raises(ValueError, match="uninitialized"):
        shape_signature(nn.LazyLinear(4), {})


def test_bad_inputs_raise_type_error() -> None:
    with pytest.raises(TypeError):
        shape_signature("not a model", {})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        shape_signature(nn.ReLU(), [("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        shape_signature(nn.ReLU(), {1: 2})  # type: ignore[dict-item]


def test_fusible_params_derived_from_signature() -> None:
    def signature_fn(params: Mapping[str, Any]) -> Signature:
        model = _meta(_mlp, params["hidden"], params["depth"])
        return shape_signature(model, {"batch_size": params["batch_size"]})

    params = {"hidden": 64, "depth": 2, "batch_size": 32, "lr": 1e-3, "weight_decay": 0.0}
    candidates = {
        "hidden": [64, 128],
        "depth": [2],
        "batch_size": [32, 64],
        "lr": [1e-4, 1e-3, 1e-2],
        "weight_decay": [0.0, 1e-4],
    }
    assert fusible_params(signature_fn, params, candidates) == {
        "hidden": False,
        "depth": True,  # only one candidate value: never changes the signature
        "batch_size": False,
        "lr": True,
        "weight_decay": True,
    }


def test_numeric_config_the_fusion_engine_refuses_splits_signature() -> None:
    # eps must be shared by one fused LayerNorm call; dropout p may differ per member.
    assert shape_signature(nn.LayerNorm(8, eps=1e-5), {}).digest != shape_signature(nn.LayerNorm(8, eps=1e-6), {}).digest
    assert shape_signature(nn.LeakyReLU(0.1), {}).digest != shape_signature(nn.LeakyReLU(0.2), {}).digest
    assert shape_signature(nn.Dropout(0.1), {}).digest == shape_signature(nn.Dropout(0.5), {}).digest
    bn_a = nn.BatchNorm1d(4, momentum=0.1)
    bn_b = nn.BatchNorm1d(4, momentum=0.3)
    assert shape_signature(bn_a, {}).digest == shape_signature(bn_b, {}).digest
