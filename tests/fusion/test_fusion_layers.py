"""Equivalence of every fused layer kind (float64, 3 training steps + eval)."""

from __future__ import annotations

import functools

import pytest
import torch
from _fusion_helpers import run_equivalence
from torch import nn

import fusetune.fusion as fusion

B = 3
SGD_KW = dict(lr=[0.1, 0.05, 0.02], momentum=[0.9, 0.0, 0.5], weight_decay=[0.0, 1e-2, 5e-3])
ADAM_KW = dict(lr=[1e-2, 3e-3, 2e-2], betas=[(0.9, 0.999), (0.8, 0.99), (0.5, 0.9)])


def sgd():
    return (lambda i, m: torch.optim.SGD(m.parameters(), **{k: v[i] for k, v in SGD_KW.items()}),
            lambda f: fusion.optim.SGD(f.parameters(), **SGD_KW))


def adam():
    return (lambda i, m: torch.optim.Adam(m.parameters(), **{k: v[i] for k, v in ADAM_KW.items()}),
            lambda f: fusion.optim.Adam(f.parameters(), **ADAM_KW))


def cls_batch(in_shape, classes=5, n=4, dtype=torch.float64):
    def make(b):
        return torch.randn(b, n, *in_shape, dtype=dtype), torch.randint(0, classes, (b, n))
    return make


def token_batch(vocab, seq, classes=5, n=4, pad=None):
    def make(b):
        x = torch.randint(0, vocab, (b, n, seq))
        if pad is not None:
            x[:, :, -2:] = pad
        return x, torch.randint(0, classes, (b, n))
    return make


LAYER_MODELS = {
    "conv1d_pools": (lambda: nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1, padding_mode="reflect"), nn.BatchNorm1d(4), nn.ELU(), nn.MaxPool1d(2),
        nn.Conv1d(4, 4, 3, stride=2, dilation=1, groups=2), nn.AvgPool1d(2, ceil_mode=True),
        nn.AdaptiveMaxPool1d(2), nn.Flatten(), nn.Linear(8, 5)), (2, 12)),
    "conv3d_bn3d": (lambda: nn.Sequential(
        nn.Conv3d(1, 3, 3, padding=1), nn.BatchNorm3d(3), nn.SiLU(), nn.AdaptiveAvgPool3d(1),
        nn.Flatten(), nn.Linear(3, 5)), (1, 4, 4, 4)),
    "conv_transpose": (lambda: nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2), nn.ConvTranspose2d(4, 3, 3, stride=2, output_padding=1), nn.Hardswish(),
        nn.Flatten(2), nn.ConvTranspose1d(3, 2, 2, stride=2, groups=1), nn.AdaptiveAvgPool1d(3),
        nn.Flatten(), nn.Linear(6, 5)), (2, 7, 7)),
    "groupnorm_layernorm": (lambda: nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Mish(), nn.Flatten(), nn.LayerNorm(64),
        nn.Unflatten(1, (4, 16)), nn.LayerNorm([4, 16], elementwise_affine=True), nn.Flatten(),
        nn.Linear(64, 5)), (2, 6, 6)),
    "bn1d_3d_input": (lambda: nn.Sequential(
        nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4, affine=False), nn.Softplus(), nn.Flatten(),
        nn.BatchNorm1d(20, track_running_stats=False), nn.Linear(20, 5)), (3, 5)),
    "activations": (lambda: nn.Sequential(
        nn.Linear(6, 8), nn.LeakyReLU(0.1), nn.Linear(8, 8), nn.Hardtanh(), nn.Linear(8, 8), nn.SELU(),
        nn.Linear(8, 8), nn.CELU(), nn.Sigmoid(), nn.Linear(8, 8), nn.Softsign(), nn.Tanhshrink(),
        nn.Identity(), nn.ReLU6(), nn.Hardsigmoid(), nn.LogSigmoid(), nn.Softmin(dim=1),
        nn.Linear(8, 5), nn.LogSoftmax(dim=1)), (6,)),
    "activations_2d": (lambda: nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GLU(dim=1), nn.Softmax2d(), nn.AvgPool2d(2), nn.Conv2d(2, 4, 1),
        nn.Threshold(0.1, -1.0), nn.Hardshrink(0.2), nn.Softshrink(0.1), nn.LPPool2d(2, 2), nn.Flatten(),
        nn.Linear(4, 5), nn.Softmax(dim=-1)), (2, 6, 6)),
    "instancenorm": (lambda: nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.InstanceNorm2d(3, affine=True), nn.ReLU(), nn.Conv2d(3, 3, 1),
        nn.InstanceNorm2d(3), nn.Flatten(), nn.Linear(3 * 16, 5)), (2, 6, 6)),
    "prelu": (lambda: nn.Sequential(
        nn.Conv2d(2, 3, 3), nn.PReLU(3, init=0.1), nn.Flatten(), nn.Linear(3 * 16, 8), nn.PReLU(),
        nn.Linear(8, 5)), (2, 6, 6)),
}


@pytest.mark.parametrize("name", sorted(LAYER_MODELS))
def test_layer_model(name):
    factory, in_shape = LAYER_MODELS[name]
    ref, fused = sgd()
    run_equivalence(factory, cls_batch(in_shape), ref, fused, b=B)


class Containers(nn.Module):
    """ModuleList / ModuleDict / Bilinear / indexing in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.heads = nn.ModuleDict({"a": nn.Linear(6, 3), "b": nn.Linear(6, 3)})
        self.bil = nn.Bilinear(3, 3, 5)

    def forward(self, x):
        for blk in self.blocks:
            x = x + torch.relu(blk(x))
        return self.bil(self.heads["a"](x), self.heads["b"](x[:, torch.arange(5, -1, -1)]))


def test_containers_bilinear():
    ref, fused = adam()
    run_equivalence(Containers, cls_batch((6,)), ref, fused, b=B)


class SeqFirstLinear(nn.Module):
    """Linear/LayerNorm/Dropout applied with the batch on axis 1: found by the dry run."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.drop = nn.Dropout(0.0)
        self.out = nn.Linear(6, 5)

    def forward(self, x):  # x: [N, T, 4]
        h = self.drop(self.norm(self.proj(x.transpose(0, 1))))  # [T, N, 6]
        return self.out(h.mean(0))


def test_batch_axis_found_by_dry_run():
    ref, fused = sgd()
    f = run_equivalence(SeqFirstLinear, cls_batch((7, 4)), ref, fused, b=B)
    assert f.module.proj.batch_dim == 1 and f.module.norm.batch_dim == 1 and f.module.out.batch_dim == 0


class EmbedBag(nn.Module):
    def __init__(self, padding_idx=None, max_norm=None) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=padding_idx, max_norm=max_norm)
        self.fc = nn.Linear(6, 5)

    def forward(self, tokens):
        return self.fc(self.emb(tokens).mean(1))


@pytest.mark.parametrize("kw", [{}, {"padding_idx": 0}, {"padding_idx": 3, "max_norm": 1.0}])
def test_embedding(kw):
    ref, fused = adam() if "max_norm" not in kw else sgd()
    run_equivalence(lambda: EmbedBag(**kw), token_batch(11, 6, pad=kw.get("padding_idx")), ref, fused, b=B)


def test_embedding_padding_row_gets_no_gradient():
    torch.manual_seed(0)
    fused = fusion.fuse([EmbedBag(padding_idx=2) for _ in range(B)])
    tokens = torch.full((B, 3, 4), 2)
    tokens[:, :, 0] = 5
    fused(tokens).sum().backward()
    assert not fused.module.emb.weight.grad[:, 2].any()
    assert fused.module.emb.weight.grad[:, 5].abs().sum() > 0


class Attn(nn.Module):
    def __init__(self, batch_first: bool, **kw) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, **kw)
        self.fc = nn.Linear(8, 5)

    def forward(self, x, pad):  # x [N, T, 8], pad [N, T] bool
        seq = x if self.batch_first else x.transpose(0, 1)
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        out, w = self.attn(seq, seq, seq, key_padding_mask=pad, attn_mask=causal)
        out = out if self.batch_first else out.transpose(0, 1)
        return self.fc(out.mean(1) + w.sum(1) @ x.new_ones(w.shape[-1], 8))


def attn_batch(n=4, t=5):
    def make(b):
        x = torch.randn(b, n, t, 8, dtype=torch.float64)
        pad = torch.zeros(b, n, t, dtype=torch.bool)
        pad[:, 1:, -1] = True
        pad[1, 2, -2:] = True
        return (x, pad), torch.randint(0, 5, (b, n))
    return make


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kw", [{}, {"add_bias_kv": True, "add_zero_attn": True}, {"kdim": 8, "vdim": 8, "bias": False}])
def test_multihead_attention(batch_first, kw):
    # SGD, not Adam: the key-projection bias has an exactly zero true gradient
    # (softmax ignores a constant added to all scores), so Adam would amplify
    # rounding noise; see run_equivalence.
    ref, fused = sgd()
    run_equivalence(lambda: Attn(batch_first, **kw), attn_batch(), ref, fused, b=B)


class TransformerClassifier(nn.Module):
    """Token classifier with padding masks (zoo model)."""

    def __init__(self, vocab=13, d=8, batch_first=True, norm_first=False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 2, 16, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 5)

    def forward(self, tokens):
        pad = tokens == 0
        h = self.emb(tokens)
        if not self.batch_first:
            h = h.transpose(0, 1)
        h = self.enc(h, src_key_padding_mask=pad)
        if not self.batch_first:
            h = h.transpose(0, 1)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


@pytest.mark.parametrize("batch_first,norm_first", [(True, False), (False, True)])
def test_transformer_encoder_classifier(batch_first, norm_first):
    ref, fused = sgd()  # SGD for the same reason as test_multihead_attention
    run_equivalence(lambda: TransformerClassifier(batch_first=batch_first, norm_first=norm_first),
                    token_batch(13, 6, pad=0), ref, fused, b=B)


class RNNLM(nn.Module):
    """LSTM/GRU language model (zoo model): next-token logits [N, T, V]."""

    def __init__(self, kind="lstm", vocab=11, batch_first=True, layers=2, bidirectional=False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(vocab, 6)
        rnn = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = rnn(6, 7, num_layers=layers, batch_first=batch_first, bidirectional=bidirectional)
        self.out = nn.Linear(7 * (2 if bidirectional else 1), vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        if not self.batch_first:
            h = h.transpose(0, 1)
        y, _ = self.rnn(h)
        if not self.batch_first:
            y = y.transpose(0, 1)
        return self.out(y).transpose(1, 2)  # [N, V, T] for cross_entropy


def lm_batch(vocab=11, n=3, t=5):
    def make(b):
        return torch.randint(0, vocab, (b, n, t)), torch.randint(0, vocab, (b, n, t))
    return make


@pytest.mark.parametrize("kind,batch_first,bidirectional", [("lstm", True, False), ("lstm", False, True),
                                                            ("gru", True, True)])
def test_rnn_language_model(kind, batch_first, bidirectional):
    ref, fused = adam()
    run_equivalence(lambda: RNNLM(kind, batch_first=batch_first, bidirectional=bidirectional), lm_batch(),
                    ref, fused, b=B)


def test_hidden_state_outputs_unfolded():
    """(out, (h, c)) from an LSTM with seq-first internals: the dry run finds the
    batch on axis 1 of h and c, and every tensor comes back member-first."""

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(3, 4, num_layers=2)

        def forward(self, x):  # x: [N, T, 3] (batch-first model input)
            return self.lstm(x.transpose(0, 1))

    torch.manual_seed(0)
    models = [Wrapped().double() for _ in range(2)]
    fused = fusion.fuse(models)
    x = torch.randn(2, 6, 5, 3, dtype=torch.float64)
    out, (h, c) = fused(x)
    assert out.shape == (2, 5, 6, 4) and h.shape == (2, 2, 6, 4) and c.shape == (2, 2, 6, 4)
    for b, m in enumerate(models):
        ref_out, (ref_h, ref_c) = m(x[b])
        torch.testing.assert_close(out[b], ref_out, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(h[b], ref_h, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(c[b], ref_c, rtol=1e-10, atol=1e-12)


def test_seq_first_model_input_is_refused_clearly():
    """Fused inputs are [B, N, ...]: axis 0 of each member's input must be its batch."""
    fused = fusion.fuse([nn.Sequential(nn.LSTM(3, 4)) for _ in range(2)])
    with pytest.raises(fusion.FusionError, match="batch axis"):
        fused(torch.randn(2, 5, 6, 3))


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_conv_and_batchnorm_implementations(impl, monkeypatch):
    """Both per-layer strategies ("auto" picks by size) are exact."""
    monkeypatch.setattr(fusion.nn.Conv, "impl", impl)
    monkeypatch.setattr(fusion.nn.BatchNorm, "impl", "loop" if impl == "loop" else "channels")
    ref, fused = sgd()
    for name in ("conv1d_pools", "conv3d_bn3d", "bn1d_3d_input"):
        factory, in_shape = LAYER_MODELS[name]
        run_equivalence(factory, cls_batch(in_shape), ref, fused, b=B)


@pytest.mark.parametrize("impl", ["native", "batched"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_implementations(impl, kind, monkeypatch):
    monkeypatch.setattr(fusion.nn.LSTM if kind == "lstm" else fusion.nn.GRU, "impl", impl)
    ref, fused = sgd()
    for batch_first, bidirectional in ((True, True), (False, False)):
        run_equivalence(functools.partial(RNNLM, kind, batch_first=batch_first, bidirectional=bidirectional), lm_batch(),
                        ref, fused, b=B)


class Seq2Seq(nn.Module):
    """nn.Transformer-style encoder-decoder with causal and padding masks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 8, padding_idx=0)
        self.tr = nn.Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                                 dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 5)

    def forward(self, src):
        tgt = src[:, :4]
        mask = self.tr.generate_square_subsequent_mask(4, dtype=self.emb.weight.dtype)
        h = self.tr(self.emb(src), self.emb(tgt), tgt_mask=mask, src_key_padding_mask=src == 0)
        return self.out(h.mean(1))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")  # torch's own reference run
def test_transformer_encoder_decoder():
    ref, fused = sgd()
    run_equivalence(Seq2Seq, token_batch(13, 6, pad=0), ref, fused, b=B)


def test_encoder_nested_tensor_inference_per_member():
    """In inference torch runs a TransformerEncoder on nested tensors when a
    member's padding is left-aligned (padded outputs then 0); that decision is
    per member, and the fused array reproduces it for each."""

    class Enc(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2)  # enable_nested_tensor=True (default)

        def forward(self, x, pad):
            return self.enc(x, src_key_padding_mask=pad)

    torch.manual_seed(0)
    members = [Enc().double().eval() for _ in range(3)]
    fused = fusion.fuse(members).eval()
    x = torch.randn(3, 4, 5, 8, dtype=torch.float64)
    pad = torch.zeros(3, 4, 5, dtype=torch.bool)
    pad[0, :, -1] = True  # left-aligned: torch nests
    pad[1, 0, 1] = True  # a hole: torch does not nest
    pad[2, 1:, -2:] = True  # left-aligned
    with torch.no_grad():
        out = fused(x, pad)
        for b, m in enumerate(members):
            ref = m(x[b], pad[b])
            torch.testing.assert_close(out[b], ref, rtol=1e-10, atol=1e-12)
    assert (out[0, :, -1] == 0).all() and (out[1] != 0).all()


@pytest.mark.parametrize("name", sorted(LAYER_MODELS))
def test_single_member_fast_paths(name):
    """B = 1 runs each twin as the ordinary layer (no batching overhead); still exact."""
    factory, in_shape = LAYER_MODELS[name]
    run_equivalence(factory, cls_batch(in_shape),
                    lambda i, m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                    lambda f: fusion.optim.SGD(f.parameters(), lr=0.1, momentum=0.9), b=1)
