"""Fused MultiheadAttention, and Transformer layers pinned to their composable path."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import FusionError
from ._base import FusedLayer, check_same_config, stack_param
from ._batched_call import in_batched_call, per_member_flags
from ._linear import Linear


def _canonical(mask: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor | None:
    """Bool masks (True = masked) to additive float masks, like torch."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=like.dtype).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise FusionError(f"MultiheadAttention: {name} must be bool or float, got {mask.dtype}")
    return mask.to(like.dtype)


class MultiheadAttention(FusedLayer):
    """B ``nn.MultiheadAttention`` layers; projections are batched matmuls.

    Supports ``batch_first`` both ways, ``attn_mask`` (2-D, or 3-D per sample
    and head), ``key_padding_mask`` (bool or float), ``need_weights`` with
    head-averaged or per-head weights, separate ``kdim``/``vdim``,
    ``add_bias_kv`` and ``add_zero_attn`` -- the attention itself is computed
    per sample, so it never mixes members.
    """

    in_proj_weight: nn.Parameter | None
    q_proj_weight: nn.Parameter | None
    k_proj_weight: nn.Parameter | None
    v_proj_weight: nn.Parameter | None
    in_proj_bias: nn.Parameter | None
    bias_k: nn.Parameter | None
    bias_v: nn.Parameter | None
    out_proj: Linear

    def __init__(self, num_members: int, mha: nn.MultiheadAttention) -> None:
        super().__init__(num_members)
        self.embed_dim = mha.embed_dim
        self.kdim = mha.kdim
        self.vdim = mha.vdim
        self._qkv_same_embed_dim = mha._qkv_same_embed_dim
        self.num_heads = mha.num_heads
        self.dropout = mha.dropout
        self.batch_first = mha.batch_first
        self.head_dim = mha.head_dim
        self.add_zero_attn = mha.add_zero_attn

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Self:
        check_same_config(members, path)
        mhas = [m for m in members if isinstance(m, nn.MultiheadAttention)]
        assert len(mhas) == len(members)  # check_same_config: the members are of one class
        layer = cls(len(members), mhas[0])
        for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                     "bias_k", "bias_v"):
            tensors = [getattr(m, name) for m in members]
            layer.register_parameter(name, stack_param(tensors))
        layer.out_proj = Linear.from_members([m.out_proj for m in mhas], f"{path}.out_proj")
        return layer

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Per-member linear map of a batch-first [B*N, L, F] tensor."""
        b = self.num_members
        xv = x.reshape(b, -1, x.shape[-1])
        wt = weight.transpose(1, 2)
        out = torch.bmm(xv, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), xv, wt)
        return out.reshape(*x.shape[:-1], weight.shape[1])

    def _in_projections(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query, key and value projection weights: slices of the one packed weight when
        q, k and v share ``embed_dim`` (as torch packs them), else the three weights."""
        e = self.embed_dim
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            assert w is not None
            return w[:, :e], w[:, e : 2 * e], w[:, 2 * e :]
        wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        assert wq is not None and wk is not None and wv is not None
        return wq, wk, wv

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.dim() != 3:
            raise FusionError("fused MultiheadAttention needs batched 3-D inputs")
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        bn, tgt_len, e = query.shape
        self._check_batch(query)
        h, hd = self.num_heads, self.head_dim
        e_w = self.embed_dim
        bias = self.in_proj_bias
        bq = bk = bv = None
        if bias is not None:
            bq, bk, bv = bias[:, :e_w], bias[:, e_w : 2 * e_w], bias[:, 2 * e_w :]
        wq, wk, wv = self._in_projections()
        q = self._project(query, wq, bq)
        k = self._project(key, wk, bk)
        v = self._project(value, wv, bv)
        attn_mask = _canonical(attn_mask, q, "attn_mask")
        key_padding_mask = _canonical(key_padding_mask, q, "key_padding_mask")
        if self.bias_k is not None and self.bias_v is not None:
            b = self.num_members
            n = bn // b
            k = torch.cat([k, self.bias_k.expand(b, n, 1, e_w).reshape(bn, 1, e_w)], dim=1)
            v = torch.cat([v, self.bias_v.expand(b, n, 1, e_w).reshape(bn, 1, e_w)], dim=1)
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        # [BN, L, E] -> [BN, H, L, hd]
        q = q.view(bn, tgt_len, h, hd).transpose(1, 2)
        k = k.view(bn, k.shape[1], h, hd).transpose(1, 2)
        v = v.view(bn, v.shape[1], h, hd).transpose(1, 2)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(bn, h, 1, hd)], dim=2)
            v = torch.cat([v, v.new_zeros(bn, h, 1, hd)], dim=2)
            if attn_mask is not None:
                attn_mask = F.pad(attn_mask, (0, 1))
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        src_len = k.shape[2]
        mask = None
        if attn_mask is not None:
            mask = attn_mask.view(bn, h, tgt_len, src_len) if attn_mask.dim() == 3 else attn_mask
        if key_padding_mask is not None:
            kpm = key_padding_mask.view(bn, 1, 1, src_len)
            mask = kpm if mask is None else mask + kpm
        dropout_p = self.dropout if self.training else 0.0
        if not need_weights:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
            weights = None
        else:
            scores = torch.matmul(q * math.sqrt(1.0 / hd), k.transpose(-2, -1))
            if mask is not None:
                scores = scores + mask
            weights = torch.softmax(scores, dim=-1)
            attn = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
            out = torch.matmul(attn, v)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        out = out.transpose(1, 2).reshape(bn, tgt_len, e_w)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights


class EncoderLayerComposablePath(nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` that always runs its composable path.

    torch's inference fast path hands the layer's weights to one fused kernel
    that would treat our stacked ``[B, ...]`` weights as one model's; the
    composable path instead calls the (fused) submodules, computing exactly
    what the fast path computes.
    """

    def forward(
        self,
        src: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(src_mask), other_name="src_mask", target_type=src.dtype,
        )
        src_mask = F._canonical_mask(
            mask=src_mask, mask_name="src_mask", other_type=None, other_name="",
            target_type=src.dtype, check_other=False,
        )
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x


class EncoderComposablePath(nn.TransformerEncoder):
    """``nn.TransformerEncoder`` that runs its layers on padded tensors, always.

    Where torch would switch to nested tensors (inference with a padding mask),
    its output is zero at padded positions; that is reproduced exactly by
    zeroing them, so fused members match their unfused twins in every mode.
    """

    def _torch_would_nest(self, src: torch.Tensor, mask: torch.Tensor | None,
                          src_key_padding_mask: torch.Tensor | None) -> list[bool] | torch.Tensor:
        """Per member: would ``nn.TransformerEncoder.forward`` (torch 2.4-2.14) use nested tensors?

        Every condition is shared by the members except the left-alignment of
        the padding mask, which torch checks over each member's own batch. Inside a
        batched module (vmap: ``src`` is one member's), the answer is that member's,
        as a bool tensor.
        """
        b = self.layers[0].self_attn.num_members
        never = [False] * b
        first = self.layers[0]
        if (
            not torch.backends.mha.get_fastpath_enabled()
            or not getattr(self, "use_nested_tensor", False)
            or first.training
            or src.dim() != 3
            or src_key_padding_mask is None
            or mask is not None
            or src.is_nested
            or torch.is_autocast_enabled()
            or torch.compiler.is_compiling()
        ):
            return never
        attn = first.self_attn
        weights = [attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight, attn.out_proj.bias,
                   first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
                   first.linear1.weight, first.linear1.bias, first.linear2.weight, first.linear2.bias]
        tensors = [src] + [w for w in weights if w is not None]
        if src.device.type not in ("cpu", "cuda", "xpu"):
            return never
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return never
        if not getattr(self, "mask_check", True):
            return [True] * b
        batch_dim = 0 if attn.batch_first else 1
        keep = src_key_padding_mask.logical_not()
        if in_batched_call():
            return per_member_flags(torch._nested_tensor_from_mask_left_aligned, src, keep)
        return [
            bool(torch._nested_tensor_from_mask_left_aligned(s_b, k_b))
            for s_b, k_b in zip(src.chunk(b, dim=batch_dim), keep.chunk(b, dim=0))
        ]

    def forward(
        self,
        src: torch.Tensor,
        mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ) -> torch.Tensor:
        src_key_padding_mask = F._canonical_mask(
            mask=src_key_padding_mask, mask_name="src_key_padding_mask",
            other_type=F._none_or_dtype(mask), other_name="mask", target_type=src.dtype,
        )
        mask = F._canonical_mask(
            mask=mask, mask_name="mask", other_type=None, other_name="", target_type=src.dtype,
            check_other=False,
        )
        nest = self._torch_would_nest(src, mask, src_key_padding_mask)
        batch_first = self.layers[0].self_attn.batch_first
        seq_len = src.shape[1] if batch_first else src.shape[0]
        is_causal = nn.modules.transformer._detect_is_causal_mask(mask, is_causal, seq_len)
        output = src
        for mod in self.layers:
            output = mod(output, src_mask=mask, is_causal=is_causal, src_key_padding_mask=src_key_padding_mask)
        if isinstance(nest, torch.Tensor) or any(nest):
            assert src_key_padding_mask is not None
            # Zero padded positions of the members torch would have nested.
            padded = src_key_padding_mask != 0  # canonical float mask: -inf at padding
            if isinstance(nest, torch.Tensor):  # one member's answer, inside a batched module
                padded = padded & nest
            else:
                members = torch.tensor(nest, device=padded.device).repeat_interleave(padded.shape[0] // len(nest))
                padded = padded & members.unsqueeze(1)
            if not batch_first:
                padded = padded.transpose(0, 1)
            output = output.masked_fill(padded.unsqueeze(-1), 0.0)
        if self.norm is not None:
            output = self.norm(output)
        return output


def pin_composable_paths(module: nn.Module) -> None:
    """Switch torch Transformer modules in a fused tree off their fused-kernel fast paths."""
    if type(module) is nn.TransformerEncoderLayer:
        module.__class__ = EncoderLayerComposablePath
    elif type(module) is nn.TransformerEncoder:
        # The nested-tensor path also calls fused kernels with raw weights;
        # EncoderComposablePath reproduces its results instead.
        module.__class__ = EncoderComposablePath
