"""Every refusal of the fusion engine is a clear FusionError / ValueError."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusetune.fusion as fusion


def test_a_layer_no_path_can_train_names_path_and_type():
    # A module without a twin runs on the batched path (tests/fusion/test_fusion_batched.py);
    # sparse gradients of one stacked table are not one member's: refused up front.
    models = [nn.Sequential(nn.Embedding(4, 4, sparse=True), nn.Linear(4, 4)) for _ in range(2)]
    with pytest.raises(fusion.FusionError, match=r"submodule '0' \(Embedding\): sparse=True"):
        fusion.fuse(models)


def test_fusion_error_is_value_error():
    assert issubclass(fusion.FusionError, ValueError)


def test_mismatched_shapes_name_the_parameter():
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
              nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))]
    with pytest.raises(fusion.FusionError, match=r"'0\.weight'"):
        fusion.fuse(models)


def test_mismatched_classes_and_configs():
    with pytest.raises(fusion.FusionError, match="same class"):
        fusion.fuse([nn.Sequential(nn.Linear(2, 2)), nn.ModuleList([nn.Linear(2, 2)])])
    models = [nn.Sequential(nn.Linear(2, 2), nn.LeakyReLU(s)) for s in (0.1, 0.2)]
    with pytest.raises(fusion.FusionError, match=r"'1' \(LeakyReLU\).*negative_slope"):
        fusion.fuse(models)
    with pytest.raises(fusion.FusionError, match="at least one"):
        fusion.fuse([])


def test_wrong_input_shape():
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 2)) for _ in range(2)])
    with pytest.raises(fusion.FusionError, match="member axis first"):
        fused(torch.randn(3, 5, 3))


@pytest.mark.parametrize(
    "make",
    [
        lambda p: fusion.optim.SGD(p, lr=[0.1, 0.2]),
        lambda p: fusion.optim.SGD(p, lr=0.1, momentum=[0.9] * 4),
        lambda p: fusion.optim.SGD(p, lr=0.1, weight_decay=[0.0, 0.1]),
        lambda p: fusion.optim.Adam(p, lr=[1e-3] * 2),
        lambda p: fusion.optim.Adam(p, eps=[1e-8, 1e-8]),
        lambda p: fusion.optim.Adam(p, weight_decay=[0.0] * 5),
        lambda p: fusion.optim.AdamW(p, lr=[1e-3] * 2),
        lambda p: fusion.optim.RMSprop(p, alpha=[0.9] * 2),
        lambda p: fusion.optim.Adagrad(p, lr_decay=[0.0] * 2),
        lambda p: fusion.optim.Adadelta(p, rho=[0.9] * 2),
    ],
)
def test_wrong_length_hyperparameter(make):
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 2)) for _ in range(3)])
    with pytest.raises(ValueError, match=r"(lr|momentum|weight_decay|eps|alpha|lr_decay|rho): expected"):
        make(fused.parameters())


def test_wrong_betas():
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 2)) for _ in range(3)])
    with pytest.raises(ValueError, match="betas"):
        fusion.optim.Adam(fused.parameters(), betas=[(0.9, 0.99), (0.9, 0.99)])
    with pytest.raises(ValueError, match="Invalid beta"):
        fusion.optim.Adam(fused.parameters(), betas=[(0.9, 0.99), (0.9, 1.5), (0.9, 0.99)])


def test_nesterov_needs_momentum_per_member():
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 2)) for _ in range(2)])
    with pytest.raises(ValueError, match="Nesterov"):
        fusion.optim.SGD(fused.parameters(), lr=0.1, momentum=[0.9, 0.0], nesterov=True)


def test_unfused_parameters_refused_by_fused_optimizer():
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 2)) for _ in range(3)])
    with pytest.raises(fusion.FusionError, match="member axis"):
        fusion.optim.SGD(list(fused.parameters()) + [nn.Parameter(torch.zeros(2, 2))], lr=0.1)


def test_wrong_length_scheduler_argument_and_clip():
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 2)) for _ in range(3)])
    opt = fusion.optim.SGD(fused.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="gamma"):
        fusion.lr_scheduler.StepLR(opt, step_size=2, gamma=[0.1, 0.2])
    fused(torch.randn(3, 4, 3)).sum().backward()
    with pytest.raises(ValueError, match="max_norm"):
        fusion.clip_grad_norm_(fused.parameters(), [1.0, 2.0])


def test_member_index_out_of_range():
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 2)) for _ in range(2)])
    with pytest.raises(IndexError):
        fused.member_state_dict(2)
