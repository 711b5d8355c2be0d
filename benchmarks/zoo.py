"""The zoo of real model shapes: one definition each, shared by the fusion
benchmark (``benchmarks/fusion.py``) and the fusion tests
(``tests/fusion/test_fusion_zoo.py``, ``tests/fusion/test_models_people_write.py``).

Defaults are the benchmark's sizes; the tests pass smaller ones where they
use smaller models (e.g. ``ResNet18(width=4)``, ``PointNet(classes=5)``).
The models are plain ``torch.nn`` code; nothing here knows about fusion. The
second half are models as researchers write them (a position ``nn.Parameter``,
``arange`` positions, a causal-mask buffer, weight tying, LayerScale, ...),
written the way their papers' reference code does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp() -> nn.Module:
    """The digits MLP shape (8x8 images), hidden 128."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def cnn() -> nn.Module:
    """The digits CNN shape: conv + BatchNorm + pooling on 8x8 images."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """CIFAR-shaped ResNet-18 (3x3 stem, [2, 2, 2, 2] basic blocks) at reduced width.

    Width 8 in the benchmark (full width 64 is out of reach for timing on a
    2-core CPU), 4 in the tests.
    """

    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers = []
        cin = width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.linear = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1)
        return self.linear(out.view(out.size(0), -1))


class TransformerClassifier(nn.Module):
    """Token classifier: embedding, 2 encoder layers, padding mask, mean pooling."""

    def __init__(self, vocab: int = 1000, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pad = tokens == 0
        h = self.enc(self.emb(tokens), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))


class LSTMLM(nn.Module):
    """LSTM language model: next-token logits, returned as [N, V, T] for cross_entropy."""

    def __init__(self, vocab: int = 1000, d: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(self.emb(tokens))
        return self.out(y).transpose(1, 2)


class TNet(nn.Module):
    """PointNet's input transform: a k x k matrix per sample (identity + learned)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(nn.Conv1d(k, 16, 1), nn.BatchNorm1d(16), nn.ReLU())
        self.fc = nn.Linear(16, k * k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, k, P]
        feat = torch.max(self.conv(x), 2)[0]
        m = self.fc(feat) + torch.eye(self.k, dtype=x.dtype, device=x.device).flatten()
        return m.view(-1, self.k, self.k)


class PointNet(nn.Module):
    """PointNet classifier with an input transform (per-sample torch.bmm in forward).

    Input [N, 3, P] points; small widths (point MLP 3-16-32, head 32-16-classes).
    """

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.tnet = TNet(3)
        self.mlp = nn.Sequential(nn.Conv1d(3, 16, 1), nn.BatchNorm1d(16), nn.ReLU(),
                                 nn.Conv1d(16, 32, 1), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.0),
                                  nn.Linear(16, classes))

    def forward(self, pts: torch.Tensor) -> torch.Tensor:  # [N, 3, P]
        pts = torch.bmm(self.tnet(pts), pts)
        return self.head(self.mlp(pts).max(dim=2).values)


# ----------------------------------------------------------------------------- models people write


class ViTBlock(nn.Module):
    """Pre-norm encoder block: self-attention (``nn.MultiheadAttention``) and an MLP."""

    def __init__(self, d: int, heads: int, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, mlp_ratio * d), nn.GELU(), nn.Linear(mlp_ratio * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Vision Transformer: patch embedding, a class token and a learned position embedding
    (both ``nn.Parameter`` of the model itself), pre-norm blocks, the class token's head."""

    def __init__(self, image: int = 16, patch: int = 4, d: int = 32, heads: int = 2, depth: int = 2,
                 classes: int = 10, channels: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(channels, d, patch, patch)
        tokens = (image // patch) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, d) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [N, C, H, W]
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class CausalSelfAttention(nn.Module):
    """GPT-2's attention: one qkv projection, a causal-mask buffer, ``F.scaled_dot_product_attention``."""

    def __init__(self, d: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.register_buffer("bias", mask.view(1, 1, context, context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, d]
        n, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(n, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, :, :t, :t])
        return self.c_proj(y.transpose(1, 2).reshape(n, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, context)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-style decoder: token and position ``nn.Embedding`` (positions from ``torch.arange``),
    pre-norm blocks, the output layer tied to the token embedding. Returns ``[N, T, vocab]``."""

    def __init__(self, vocab: int = 128, d: int = 32, heads: int = 2, depth: int = 2, context: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList([GPTBlock(d, heads, context) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # [N, T] token ids
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``[N, T, vocab]`` logits, as GPT training code computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class SinusoidalEncoding(nn.Module):
    """The fixed sine/cosine position table of "Attention Is All You Need", a registered buffer."""

    def __init__(self, d: int, max_len: int = 64) -> None:
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(1, max_len, d)
        pe[0, :, 0::2] = torch.sin(position * div)
        pe[0, :, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, d]
        return x + self.pe[:, : x.shape[1]]


class SinusoidalTransformer(nn.Module):
    """Token classifier: embedding scaled by sqrt(d), sinusoidal positions, ``nn.TransformerEncoder``."""

    def __init__(self, vocab: int = 128, d: int = 32, heads: int = 2, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(vocab, d)
        self.pos = SinusoidalEncoding(d)
        layer = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.pos(self.emb(tokens) * math.sqrt(self.d))
        return self.head(self.encoder(x).mean(1))


class ConvNeXtBlock(nn.Module):
    """ConvNeXt block: depthwise 7x7 conv, channels-last LayerNorm and MLP, a LayerScale gain."""

    def __init__(self, dim: int, layer_scale: float = 1e-1) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(layer_scale * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, H, W]
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """Patchify stem, ConvNeXt blocks, global average pooling, LayerNorm and a linear head."""

    def __init__(self, dim: int = 16, depth: int = 2, classes: int = 10, channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, dim, 2, 2)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(self.norm(x.mean((-2, -1))))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNormMLP(nn.Module):
    """LLaMA-style residual stack without attention: ``nn.RMSNorm`` then a SwiGLU MLP, mean-pooled."""

    def __init__(self, vocab: int = 128, d: int = 32, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList([nn.RMSNorm(d) for _ in range(depth)])
        self.mlps = nn.ModuleList([SwiGLU(d, 2 * d) for _ in range(depth)])
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return self.head(self.norm(x).mean(1))


class WeightNormTCN(nn.Module):
    """Temporal convolutions with ``torch.nn.utils.parametrizations.weight_norm`` (as in TCN/WaveNet)."""

    def __init__(self, channels: int = 4, hidden: int = 16, classes: int = 10) -> None:
        super().__init__()
        weight_norm = nn.utils.parametrizations.weight_norm
        self.conv1 = weight_norm(nn.Conv1d(channels, hidden, 3, padding=2, dilation=2))
        self.conv2 = weight_norm(nn.Conv1d(hidden, hidden, 3, padding=4, dilation=4))
        self.head = weight_norm(nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C, T]
        x = F.relu(self.conv1(x))
        x = x + F.relu(self.conv2(x))
        return self.head(x.mean(-1))


class ContrastiveDualEncoder(nn.Module):
    """CLIP-style: an image MLP and a text bag-of-embeddings, normalised, compared with a
    learnable temperature (``logit_scale``, an ``nn.Parameter`` of the model). Returns the
    ``[N, N]`` image-to-text logits of the batch."""

    def __init__(self, features: int = 48, vocab: int = 128, d: int = 16) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(features, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.text_emb = nn.Embedding(vocab, d)
        self.text_proj = nn.Linear(d, d)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        img = F.normalize(self.image(images), dim=-1)
        txt = F.normalize(self.text_proj(self.text_emb(tokens).mean(1)), dim=-1)
        return self.logit_scale.exp() * img @ txt.t()


def contrastive_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric cross-entropy; ``targets`` are the matching indices (``arange(N)``)."""
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.t(), targets)) / 2


class EinsumAttention(nn.Module):
    """Multi-head self-attention written with ``torch.einsum``, with a learned relative position
    bias per head (an ``nn.Parameter``, as in T5 or Swin)."""

    def __init__(self, d: int, heads: int, tokens: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.rel_bias = nn.Parameter(torch.zeros(heads, tokens, tokens))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, d]
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, d // self.heads).unbind(2)
        scores = torch.einsum("nihc,njhc->nhij", q, k) / math.sqrt(d // self.heads) + self.rel_bias
        y = torch.einsum("nhij,njhc->nihc", scores.softmax(-1), v)
        return self.out(y.reshape(n, t, d))


class EinsumTransformer(nn.Module):
    """Token classifier of post-norm blocks around :class:`EinsumAttention`."""

    def __init__(self, vocab: int = 128, d: int = 32, heads: int = 2, tokens: int = 16, depth: int = 2,
                 classes: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.ModuleList([EinsumAttention(d, heads, tokens) for _ in range(depth)])
        self.norm = nn.ModuleList([nn.LayerNorm(d) for _ in range(depth)])
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for attn, norm in zip(self.attn, self.norm):
            x = norm(x + attn(x))
        return self.head(x.mean(1))
