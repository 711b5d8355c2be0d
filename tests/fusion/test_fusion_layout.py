"""fusion.layout: the one rule for which members fuse, and fuse()'s use of it."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fusetune.fusion as fusion


class Scale(nn.Module):
    """A user module configured by plain attributes that its forward reads."""

    def __init__(self, scale: float = 2.0, op: str = "mul") -> None:
        super().__init__()
        self.scale = scale
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale if self.op == "mul" else x + self.scale


class MyDropout(nn.Dropout):
    """A Dropout subclass: no fused twin (twins are looked up by exact type)."""


class Owner(nn.Module):
    """Owns a raw parameter (the batched path runs it) and has a configured child."""

    def __init__(self, slope: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.act = nn.LeakyReLU(slope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x * self.w)


def _net(*tail: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), *tail)


def test_layout_lists_every_submodule_with_shapes_and_shared_config():
    entries = fusion.layout(_net(nn.ReLU(inplace=True), Scale(2.5, "add"), nn.Dropout(0.3)))
    assert [e.path for e in entries] == ["", "0", "1", "2", "3"]
    assert entries[1].type_name == "torch.nn.modules.linear.Linear"
    assert entries[1].tensors == (("weight", (3, 3)), ("bias", (3,)))
    assert entries[1].config == (("in_features", "3"), ("out_features", "3"))
    assert entries[2].config == (("inplace", "true"),)
    assert entries[3].config == (("op", '"add"'), ("scale", "2.5"))
    # Dropout p is held per member by the fused twin: not part of what members share.
    assert entries[4].config == (("inplace", "false"),)
    assert all(isinstance(e, fusion.ModuleLayout) for e in entries)


def test_layout_works_on_meta_models():
    with torch.device("meta"):
        model = _net(nn.BatchNorm1d(3))
    assert fusion.layout(model) == fusion.layout(_net(nn.BatchNorm1d(3)))


def test_relu_inplace_difference_is_refused():
    with pytest.raises(fusion.FusionError, match=r"'1' \(ReLU\): attribute 'inplace' differs"):
        fusion.fuse([_net(nn.ReLU(inplace=True)), _net(nn.ReLU())])


@pytest.mark.parametrize(
    "a,b,attr",
    [(Scale(2.0), Scale(3.0), "scale"), (Scale(op="mul"), Scale(op="add"), "op")],
)
def test_custom_plain_attribute_difference_is_refused(a, b, attr):
    # Members run member 0's Scale with member 0's attributes: fusing these would
    # silently train member 1 with the wrong scale or op.
    with pytest.raises(fusion.FusionError, match=rf"'1' \(Scale\): attribute '{attr}' differs"):
        fusion.fuse([_net(a), _net(b)])


def test_attribute_present_in_one_member_only_is_refused():
    b = Scale()
    b.extra = None
    with pytest.raises(fusion.FusionError, match=r"attribute 'extra' differs between member 0 \(absent\)"):
        fusion.fuse([_net(Scale()), _net(b)])


def test_per_member_attributes_fuse_and_are_kept_per_member():
    models = [_net(nn.BatchNorm1d(3, momentum=m), nn.Dropout(p)) for m, p in ((0.1, 0.0), (0.3, 0.5))]
    fused = fusion.fuse(models)
    assert fused.module[1].momentum == [0.1, 0.3]
    assert fused.module[2].p == [0.0, 0.5]


def test_dropout_subclass_has_no_twin_so_p_must_agree():
    with pytest.raises(fusion.FusionError, match=r"'1' \(MyDropout\): attribute 'p' differs"):
        fusion.fuse([_net(MyDropout(0.1)), _net(MyDropout(0.2))])
    fusion.fuse([_net(MyDropout(0.1)), _net(MyDropout(0.1))])


def test_nan_attributes_of_identical_members_fuse():
    # nan != nan in Python; the rule compares canonical encodings, so members built
    # alike are not refused (the old per-attribute == check refused them).
    fused = fusion.fuse([_net(Scale(math.nan)), _net(Scale(math.nan))])
    assert fused.num_members == 2


def test_equal_numbers_of_different_types_fuse_but_bool_is_not_int():
    fusion.fuse([_net(Scale(2)), _net(Scale(2.0))])
    fusion.fuse([_net(Scale(0.0)), _net(Scale(-0.0))])
    a, b = Scale(), Scale()
    a.flag, b.flag = True, 1
    with pytest.raises(fusion.FusionError, match="'flag' differs"):
        fusion.fuse([_net(a), _net(b)])


def test_config_of_a_batched_modules_children_must_agree():
    # The batched path runs member 0's copy of the module, children included.
    with pytest.raises(fusion.FusionError, match=r"'1\.act' \(LeakyReLU\).*negative_slope"):
        fusion.fuse([_net(Owner(0.1)), _net(Owner(0.2))])
    fused = fusion.fuse([_net(Owner(0.1)), _net(Owner(0.1))])
    assert fused(torch.randn(2, 4, 3)).shape == (2, 4, 3)
    assert fused.batched_modules() == {"1": None}


def test_missing_or_extra_parameter_free_submodule_is_a_fusion_error():
    with pytest.raises(fusion.FusionError, match=r"'1' \(ReLU\) exists in member 0 but not in member 1"):
        fusion.fuse([_net(nn.ReLU()), _net()])
    with pytest.raises(fusion.FusionError, match=r"member 1 has submodule '1' \(ReLU\), which member 0 lacks"):
        fusion.fuse([_net(), _net(nn.ReLU())])


def test_submodule_type_difference_names_the_path():
    with pytest.raises(fusion.FusionError, match=r"'1' \(ReLU\) is a Tanh in member 1"):
        fusion.fuse([_net(nn.ReLU()), _net(nn.Tanh())])


def test_shape_difference_is_reported_before_the_attribute_that_causes_it():
    with pytest.raises(fusion.FusionError, match=r"'0\.weight' has shape \(3, 3\) in member 0 but \(4, 3\)"):
        fusion.fuse([nn.Sequential(nn.Linear(3, 3)), nn.Sequential(nn.Linear(3, 4))])


def test_tie_in_any_member_is_refused_in_either_order():
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    plain = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    for models in ([plain, tied], [tied, plain]):
        with pytest.raises(fusion.FusionError, match="tied"):
            fusion.fuse(models)


def test_add_members_uses_the_same_rule():
    fused = fusion.fuse([_net(Scale(2.0), nn.Dropout(0.1)) for _ in range(2)])
    with pytest.raises(fusion.FusionError, match="'scale' differs"):
        fused.add_members([_net(Scale(3.0), nn.Dropout(0.1))])
    fused.add_members([_net(Scale(2.0), nn.Dropout(0.4))])
    assert fused.num_members == 3
    assert fused.module[2].p == [0.1, 0.1, 0.4]


def test_lazy_model_is_refused_with_a_clear_error():
    with pytest.raises(fusion.FusionError, match="uninitialized"):
        fusion.layout(nn.Sequential(nn.LazyLinear(3)))
