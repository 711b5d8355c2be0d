"""Fused Embedding: one lookup into the members' tables laid end to end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import FusionError
from ._base import FusedLayer


class Embedding(FusedLayer):
    """B ``nn.Embedding`` tables ``[B, V, D]`` looked up with member offsets.

    ``padding_idx`` rows get no gradient (the lookup result is detached at
    padding positions, values unchanged) and ``max_norm`` renormalises only the
    rows each member looks up, both exactly as torch does per table.
    """

    twin_of = nn.Embedding
    stacked_params = ("weight",)

    weight: nn.Parameter

    needs_batch_probe = True
    folds_unbatched = True

    def __init__(self, num_members: int, emb: nn.Embedding) -> None:
        super().__init__(num_members)
        self.num_embeddings = emb.num_embeddings
        self.embedding_dim = emb.embedding_dim
        self.padding_idx = emb.padding_idx
        self.max_norm = emb.max_norm
        self.norm_type = emb.norm_type
        self.scale_grad_by_freq = emb.scale_grad_by_freq
        self.sparse = emb.sparse

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Self:
        if getattr(members[0], "sparse", False):
            raise FusionError(
                f"submodule '{path}' (Embedding): sparse=True is not supported by fusion"
            )
        return super().from_members(members, path)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        idx = self._to_front(input)
        self._check_batch(idx)
        b, v, d = self.num_members, self.num_embeddings, self.embedding_dim
        offsets = torch.arange(b, device=idx.device, dtype=idx.dtype).mul_(v)
        flat = idx.reshape(b, -1) + offsets.unsqueeze(1)
        table = self.weight.reshape(b * v, d)
        if self.max_norm is not None:
            # torch renormalises looked-up rows in place without autograd.
            with torch.no_grad():
                torch.embedding_renorm_(
                    self.weight.data.view(b * v, d), flat.reshape(-1), self.max_norm, self.norm_type
                )
        out = F.embedding(flat, table, None, None, 2.0, self.scale_grad_by_freq, False)
        if self.padding_idx is not None:
            pad = (idx.reshape(b, -1) == self.padding_idx).unsqueeze(-1)
            out = torch.where(pad, out.detach(), out)
        return self._from_front(out.reshape(*idx.shape, d))
