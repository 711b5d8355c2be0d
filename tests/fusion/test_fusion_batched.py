"""The batched path: modules without a fused twin run once for all members under vmap.

A module owning parameters or buffers with no fused twin (a user block's ``nn.Parameter``, a
root model's own tensors, a layer configured beyond its twin) runs its own forward for all
members at once, exactly as the members would run it; fused twins inside it stay fused. Where
vmap cannot run a module, it runs once per member, still exactly, with a FusionWarning (or a
FusionError with ``fallback=False``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from _fusion_helpers import assert_close, make_members, run_equivalence
from torch import nn

import fusetune.fusion as fusion

B = 3
D = torch.float64
SGD_KW = dict(lr=[0.1, 0.05, 0.02], momentum=[0.9, 0.0, 0.5])


def sgd():
    return (lambda i, m: torch.optim.SGD(m.parameters(), **{k: v[i] for k, v in SGD_KW.items()}),
            lambda f: fusion.optim.SGD(f.parameters(), **SGD_KW))


@pytest.fixture
def no_fusion_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", fusion.FusionWarning)
        yield


def classify(shape: tuple[int, ...], classes: int = 3):
    return lambda b: (torch.randn(b, 4, *shape, dtype=D), torch.randint(0, classes, (b, 4)))


class ScaledBlock(nn.Module):
    """A user block with its own parameter, a BatchNorm child and in-place arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 6, T]
        y = self.drop(self.bn(x))
        y.mul_(self.scale[:, None])
        return F.relu_(y)


class WithBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.block = ScaledBlock()
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, 4]
        h = self.block(self.inp(x).transpose(1, 2)).transpose(1, 2)
        return self.out(h.mean(1))


@pytest.mark.usefixtures("no_fusion_warnings")
def test_user_block_runs_batched_with_exact_batchnorm_statistics():
    ref, fused = sgd()
    f = run_equivalence(WithBlock, classify((7, 4)), ref, fused, b=B)  # compares running stats too
    assert f.batched_modules() == {"block": None}
    # The block's twins stay fused inside it.
    assert type(f.module.block.bn).__name__ == "BatchNorm" and type(f.module.inp).__name__ == "Linear"
    assert type(f.module.block).__name__ == "BatchedScaledBlock"


class RootOffset(nn.Module):
    """Parameters owned by the root (a learned offset used in forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(4))
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x + self.offset))


@pytest.mark.usefixtures("no_fusion_warnings")
def test_root_with_its_own_parameters_runs_batched():
    ref, fused = sgd()
    f = run_equivalence(RootOffset, classify((4,)), ref, fused, b=B)
    assert f.batched_modules() == {"": None}


@pytest.mark.usefixtures("no_fusion_warnings")
def test_membership_changes_of_a_batched_module():
    members = make_members(RootOffset, 3, D)
    refs = [copy.deepcopy(m) for m in members]
    fused = fusion.fuse(members)
    x = torch.randn(3, 5, 4, dtype=D)
    fused(x)  # train mode: updates each member's BatchNorm statistics, as below
    for b, m in enumerate(refs):
        m(x[b])
    fused.remove_members([0])
    torch.manual_seed(3)
    new = RootOffset().to(D)
    fused.add_members([new])
    fused.eval()
    x = torch.randn(3, 5, 4, dtype=D)
    with torch.no_grad():
        out = fused(x)
        for b, m in enumerate([refs[1], refs[2], new]):
            m.eval()
            assert_close(out[b], m(x[b]), f"member {b}", D)


class Positions(nn.Module):
    """A block whose forward makes its own positions: ``arange`` into an ``nn.Embedding``."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, 4]
        return self.proj(x + self.pos(torch.arange(x.shape[1], device=x.device)))


class WithPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Positions()
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x).mean(1))


@pytest.mark.usefixtures("no_fusion_warnings")
def test_a_shared_input_inside_the_forward_makes_its_caller_batched():
    ref, fused = sgd()
    f = run_equivalence(WithPositions, classify((5, 4)), ref, fused, b=B)
    # The block calls its twin with an arange (no batch axis): the block runs under vmap,
    # where that input is shared (in_dims=None), and the twins in it stay fused.
    assert f.batched_modules() == {"block": None}
    assert type(f.module.block.pos).__name__ == "Embedding"


class Table(nn.Module):
    """Returns its own parameter: a member-dependent tensor without a batch axis."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 4))

    def forward(self) -> torch.Tensor:
        return self.table


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = Table()
        self.proj = nn.Linear(4, 4)  # applied to the table: folded on a new axis
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 5, 4]
        return self.head((x + self.proj(self.table())).mean(1))


@pytest.mark.usefixtures("no_fusion_warnings")
def test_a_module_returning_its_parameter_makes_its_caller_batched():
    ref, fused = sgd()
    f = run_equivalence(WithTable, classify((5, 4)), ref, fused, b=B)
    assert f.batched_modules() == {"": None}


class TwoUses(nn.Module):
    """One Linear applied to per-sample data and to a shared table: calls that differ."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 4]
        table = torch.linspace(-1, 1, 8, dtype=x.dtype).view(2, 4)
        return self.head(self.lin(x) + self.lin(table).sum(0) + self.bias)


@pytest.mark.usefixtures("no_fusion_warnings")
def test_a_twin_whose_calls_cannot_fold_runs_as_its_plain_layer_under_vmap():
    ref, fused = sgd()
    f = run_equivalence(TwoUses, classify((4,)), ref, fused, b=B)
    assert f.batched_modules() == {"": None}
    assert f.module.lin.fold_plans[True] is None  # its two calls have different batch axes


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.usefixtures("no_fusion_warnings")
def test_tied_parameters_stay_tied():
    ref, fused = sgd()
    f = run_equivalence(Tied, classify((3,)), ref, fused, b=B)
    assert f.module.a.weight is f.module.b.weight
    assert f.member_state_dict(1).keys() == Tied().state_dict().keys()
    f.remove_members([1])
    assert f.module.b.weight.shape == (2, 3, 3)
    f.add_members([Tied().to(D)])
    assert f.module.a.weight is f.module.b.weight and f.module.a.weight.shape == (3, 3, 3)


def test_a_configuration_beyond_the_twin_runs_batched(no_fusion_warnings):
    # The InstanceNorm twin keeps no running statistics; torch's layer under vmap does.
    def model() -> nn.Module:
        return nn.Sequential(nn.Conv1d(2, 4, 3), nn.InstanceNorm1d(4, affine=True, track_running_stats=True),
                             nn.Flatten(), nn.Linear(4 * 5, 3))

    ref, fused = sgd()
    f = run_equivalence(model, classify((2, 7)), ref, fused, b=B)
    assert f.batched_modules() == {"1": None}


class DataDependent(nn.Module):
    """Python control flow on a tensor's value: vmap cannot run it (after BatchNorm updated
    its statistics, which the first call must put back before looping over members)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.gate = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(x)
        return y * self.gate if float(y.detach().abs().max()) < 1e6 else y


def test_where_vmap_cannot_run_a_module_it_runs_once_per_member_with_a_warning():
    ref, fused = sgd()
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), DataDependent(), nn.Linear(4, 3))

    with pytest.warns(fusion.FusionWarning, match=r"submodule '1' \(DataDependent\) runs once per member in training mode.*\.item\(\)"):
        f = run_equivalence(model, classify((3,)), ref, fused, b=B)
    reason = f.batched_modules()["1"]
    assert reason is not None and reason.startswith("train: RuntimeError")


def test_fallback_false_refuses_instead_of_looping():
    fused = fusion.fuse([nn.Sequential(nn.Linear(3, 4), DataDependent()) for _ in range(2)], fallback=False)
    with pytest.raises(fusion.FusionError, match=r"submodule '1' \(DataDependent\) cannot run batched under torch.func.vmap"):
        fused(torch.randn(2, 5, 3))


def test_a_layer_without_a_batching_rule_runs_once_per_member():
    # vmap has no batching rule for nn.RNN's kernel.
    def model() -> nn.Module:
        return nn.Sequential(nn.RNN(3, 4, batch_first=True))

    refs = make_members(model, B, D)
    fused = fusion.fuse(copy.deepcopy(refs))
    x = torch.randn(B, 2, 5, 3, dtype=D)
    with pytest.warns(fusion.FusionWarning, match=r"'0' \(RNN\) runs once per member"):
        out, h = fused(x)
    assert fused.batched_modules()["0"] is not None
    for b, m in enumerate(refs):
        ref_out, ref_h = m(x[b])
        assert_close(out[b], ref_out, "output", D)
        assert_close(h[b], ref_h, "h_n", D)


class NoisyBlock(nn.Module):
    """Functional dropout in the block's own forward, and a dropout twin inside it."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.dropout(x * self.w, 0.5, self.training))


def test_dropout_in_a_batched_module_draws_per_member():
    torch.manual_seed(0)
    fused = fusion.fuse([nn.Sequential(NoisyBlock(p)) for p in (0.0, 0.5, 0.75)])
    x = fusion.broadcast(torch.ones(500, 64), 3)
    y = fused(x)
    kept = (y != 0).float().mean(dim=(1, 2))
    # Functional dropout keeps half; the twin keeps 1 - p of that, per member.
    for rate, expected in zip(kept.tolist(), (0.5, 0.25, 0.125)):
        assert abs(rate - expected) < 0.02
    # Same weights, same input: only independent draws make members differ.
    assert not torch.equal(y[0] != 0, y[1] != 0)
    assert torch.all(y[0][y[0] != 0] == 2.0)  # scaled by 1 / (1 - 0.5)


class NoBatchingRule(nn.Module):
    """Functions vmap has no batching rule for (CPU): attention with a mask made in the
    forward and without one, and weight_norm over one axis and over the whole weight."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, 4))
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4), dim=1)
        self.b = nn.utils.parametrizations.weight_norm(nn.Linear(4, 4), dim=None)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, 5, 4]
        h = self.a(x + self.pos).view(x.shape[0], 5, 2, 2).transpose(1, 2)
        mask = torch.ones(5, 5, dtype=torch.bool, device=x.device).tril()
        h = F.scaled_dot_product_attention(h, h, h, attn_mask=mask) + F.scaled_dot_product_attention(h, h, h)
        return self.head(self.b(h.transpose(1, 2).reshape(x.shape[0], 5, 4)).mean(1))


def test_functions_without_a_batching_rule_run_folded():
    ref, fused = sgd()
    with warnings.catch_warnings():
        # vmap's per-member fallback for them would warn "There is a performance drop".
        warnings.filterwarnings("error", message="There is a performance drop")
        warnings.simplefilter("error", fusion.FusionWarning)
        f = run_equivalence(NoBatchingRule, classify((5, 4)), ref, fused, b=B)
    assert f.batched_modules() == {"": None}


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout(0.0), nn.Flatten(), nn.Linear(16, 3))


@pytest.mark.usefixtures("no_fusion_warnings")
def test_layers_with_a_twin_can_be_put_on_the_batched_path():
    # Where the batched path measures faster (fusion.sizing.choose_paths), a layer class
    # runs there instead of as its twin: exactly, BatchNorm statistics included.
    ref, fused = sgd()
    batched = (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.Dropout, nn.Linear)
    f = run_equivalence(cnn, classify((1, 4, 4)), ref, fused, b=B, batched=batched)
    assert f.batched_modules() == {"0": None, "1": None, "6": None}
    assert not any(type(m).__module__.startswith("fusetune.fusion") for m in (f.module[3], f.module[4]))


def test_settings_that_differ_per_member_keep_their_twin():
    members = [nn.Sequential(nn.Linear(3, 3), nn.Dropout(p)) for p in (0.1, 0.2)]
    fused = fusion.fuse(members, batched=(nn.Dropout, nn.Linear))
    assert type(fused.module[1]).__name__ == "Dropout" and fused.module[1].p == [0.1, 0.2]
    assert fused.batched_modules() == {"0": None}


class RunningMean(nn.Module):
    """Keeps a running mean the way much research code does: by reassigning its buffer
    (``torch.func.functional_call`` alone would drop such an update)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
            self.calls = self.calls + 1
        return (x - self.mean) * self.scale


@pytest.mark.usefixtures("no_fusion_warnings")
def test_buffers_a_forward_reassigns_are_kept_per_member():
    ref, fused = sgd()
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), RunningMean(), nn.Linear(4, 3))

    f = run_equivalence(model, classify((3,)), ref, fused, b=B)  # compares the buffers after every step
    assert f.batched_modules() == {"1": None}
    assert f.module[1].calls.tolist() == [3] * B


def test_buffers_a_forward_reassigns_are_kept_per_member_in_the_loop():
    class Counting(RunningMean):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            return out if float(out.detach().abs().sum()) >= 0 else -out  # vmap cannot run this

    ref, fused = sgd()
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), Counting(), nn.Linear(4, 3))

    with pytest.warns(fusion.FusionWarning, match="runs once per member"):
        f = run_equivalence(model, classify((3,)), ref, fused, b=B)
    assert f.module[1].calls.tolist() == [3] * B


def test_the_per_member_loop_runs_each_member_with_its_own_dropout():
    class Gated(nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))
            self.drop = nn.Dropout(p)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.drop(x * self.w)
            return y if float(y.detach().sum()) >= -1e9 else -y  # vmap cannot run this

    fused = fusion.fuse([nn.Sequential(Gated(p)) for p in (0.0, 1.0, 0.0)])
    with pytest.warns(fusion.FusionWarning, match="runs once per member"):
        y = fused(fusion.broadcast(torch.ones(5, 8), 3))
    assert torch.equal(y[0], torch.ones(5, 8)) and not y[1].any() and torch.equal(y[2], torch.ones(5, 8))
    assert fused.module[0].plain.drop.p == 0.0  # the plain copy has its own setting back


class PaddedEncoder(nn.Module):
    """A root model with its own position parameter around nn.TransformerEncoder with a
    padding mask: in inference torch runs such an encoder on nested tensors (padded outputs
    become 0), deciding per batch, i.e. per member."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(6, 8) * 0.1)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 2)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.enc(self.emb(tokens) + self.pos, src_key_padding_mask=tokens == 0)
        return self.head(h.sum(1))


@pytest.mark.usefixtures("no_fusion_warnings")
def test_encoder_inference_on_nested_tensors_inside_a_batched_module():
    members = make_members(PaddedEncoder, B, D)
    fused = fusion.fuse(copy.deepcopy(members)).eval()
    tokens = torch.randint(1, 20, (B, 4, 6))
    tokens[0, :2, 4:] = 0  # member 0: left-aligned padding, torch nests
    tokens[1, 1, :2] = 0  # member 1: padding not left-aligned, torch does not
    with torch.no_grad():
        out = fused(tokens)
        for b, m in enumerate(members):
            assert_close(out[b], m.eval()(tokens[b]), f"member {b}", D)
    assert fused.batched_modules() == {"": None}
