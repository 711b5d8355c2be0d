"""Fused LSTM and GRU: batched input projections, one batched matmul per time step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from .._errors import FusionError, UnsupportedByTwin
from ._base import FusedLayer, check_same_config, stack_param


class _RNNBase(FusedLayer):
    """Shared driver of fused LSTM/GRU.

    Two strategies, same result: ``"native"`` (default) runs torch's own
    recurrent kernel once per member on its rows -- on CPU the kernel's fused
    time loop beats any Python-level loop; ``"batched"`` projects all inputs
    with one batched matmul and steps all members together, one batched
    matmul per time step, which pays off when per-step work is tiny and B is
    large (or on accelerators).
    """

    impl: str = "native"

    def __init__(self, num_members: int, rnn: nn.RNNBase) -> None:
        super().__init__(num_members)
        self.input_size = rnn.input_size
        self.hidden_size = rnn.hidden_size
        self.num_layers = rnn.num_layers
        self.bias = rnn.bias
        self.batch_first = rnn.batch_first
        self.dropout = float(rnn.dropout)
        self.bidirectional = rnn.bidirectional
        self._names = [n for n in rnn._flat_weights_names]

    @classmethod
    def from_members(cls, members: Sequence[nn.Module], path: str) -> Self:
        check_same_config(members, path)
        first = members[0]
        assert isinstance(first, nn.RNNBase)
        if getattr(first, "proj_size", 0):
            raise UnsupportedByTwin(f"submodule '{path}' ({type(first).__name__}): proj_size is not supported")
        layer = cls(len(members), first)
        for name in layer._names:
            layer.register_parameter(name, stack_param([getattr(m, name) for m in members]))
        return layer

    def _cell(self, gx: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
              w_hh: torch.Tensor, b_hh: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise FusionError(f"{type(self).__name__} has no recurrent cell")

    def _run_direction(self, x: torch.Tensor, layer: int, reverse: bool,
                       h0: torch.Tensor, c0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x: [B, T, N, F] -> outputs [B, T, N, H], final h (and c)."""
        sfx = f"_l{layer}" + ("_reverse" if reverse else "")
        w_ih = getattr(self, "weight_ih" + sfx)
        w_hh = getattr(self, "weight_hh" + sfx)
        b_ih = getattr(self, "bias_ih" + sfx, None) if self.bias else None
        b_hh = getattr(self, "bias_hh" + sfx, None) if self.bias else None
        b, t, n, f = x.shape
        xv = x.reshape(b, t * n, f)
        wt = w_ih.transpose(1, 2)
        # All time steps' input projections in one batched matmul.
        gx = (torch.bmm(xv, wt) if b_ih is None else torch.baddbmm(b_ih.unsqueeze(1), xv, wt))
        gx = gx.view(b, t, n, -1)
        h, c = h0, c0
        outs: list[torch.Tensor] = [h0] * t
        steps = range(t - 1, -1, -1) if reverse else range(t)
        for step in steps:
            h, c = self._cell(gx[:, step], h, c, w_hh, b_hh)
            outs[step] = h
        return torch.stack(outs, dim=1), h, c

    def _forward(self, input: torch.Tensor, hx: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
                 has_cell: bool) -> tuple[torch.Tensor, object]:
        if isinstance(input, nn.utils.rnn.PackedSequence):
            raise FusionError(f"fused {type(self).__name__} does not accept PackedSequence inputs")
        if input.dim() != 3:
            raise FusionError(f"fused {type(self).__name__} needs batched 3-D inputs")
        if self.impl == "native":
            return self._forward_native(input, hx, has_cell)
        b = self.num_members
        x = input if self.batch_first else input.transpose(0, 1)  # [BN, T, F]
        bn, t, _ = x.shape
        n = self._check_batch(x)
        x = x.reshape(b, n, t, -1).transpose(1, 2)  # [B, T, N, F]
        dirs = 2 if self.bidirectional else 1
        hsz = self.hidden_size
        if hx is None:
            h0 = x.new_zeros(self.num_layers * dirs, bn, hsz)
            c0 = x.new_zeros(self.num_layers * dirs, bn, hsz) if has_cell else None
        elif has_cell:
            assert isinstance(hx, tuple)
            h0, c0 = hx
        else:
            assert isinstance(hx, torch.Tensor)
            h0, c0 = hx, None
        h_n: list[torch.Tensor] = []
        c_n: list[torch.Tensor] = []
        for layer in range(self.num_layers):
            outs = []
            for d in range(dirs):
                idx = layer * dirs + d
                hi = h0[idx].reshape(b, n, hsz)
                ci = c0[idx].reshape(b, n, hsz) if c0 is not None else None
                out, hl, cl = self._run_direction(x, layer, d == 1, hi, ci)
                outs.append(out)
                h_n.append(hl.reshape(bn, hsz))
                if cl is not None:
                    c_n.append(cl.reshape(bn, hsz))
            x = outs[0] if dirs == 1 else torch.cat(outs, dim=-1)
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, True)
        # [B, T, N, D*H] -> [BN, T, D*H]
        out = x.transpose(1, 2).reshape(bn, t, -1)
        if not self.batch_first:
            out = out.transpose(0, 1)
        h_t = torch.stack(h_n)
        if has_cell:
            return out, (h_t, torch.stack(c_n))
        return out, h_t


    def _forward_native(self, input: torch.Tensor, hx: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
                        has_cell: bool) -> tuple[torch.Tensor, object]:
        b = self.num_members
        axis = 0 if self.batch_first else 1
        self._check_batch(input, axis)
        dirs = 2 if self.bidirectional else 1
        if hx is None:
            shape = (self.num_layers * dirs, input.shape[axis], self.hidden_size)
            zeros = input.new_zeros(shape)
            hx = (zeros, zeros) if has_cell else zeros
        if has_cell:
            assert isinstance(hx, tuple)
            states = [t.chunk(b, dim=1) for t in hx]
        else:
            assert isinstance(hx, torch.Tensor)
            states = [hx.chunk(b, dim=1)]
        weights = [getattr(self, name).unbind(0) for name in self._names]
        train = self.training
        outs, hs, cs = [], [], []
        for m, xm in enumerate(input.chunk(b, dim=axis)):
            flat = [w[m] for w in weights]
            if has_cell:
                out, h, c = torch._VF.lstm(
                    xm, (states[0][m], states[1][m]), flat, self.bias, self.num_layers,
                    self.dropout, train, self.bidirectional, self.batch_first,
                )
                cs.append(c)
            else:
                out, h = torch._VF.gru(
                    xm, states[0][m], flat, self.bias, self.num_layers, self.dropout, train,
                    self.bidirectional, self.batch_first,
                )
            outs.append(out)
            hs.append(h)
        output = torch.cat(outs, dim=axis)
        if has_cell:
            return output, (torch.cat(hs, dim=1), torch.cat(cs, dim=1))
        return output, torch.cat(hs, dim=1)


class LSTM(_RNNBase):
    """B ``nn.LSTM`` layers (gate order i, f, g, o as in torch)."""

    def _cell(self, gx, h, c, w_hh, b_hh):
        wt = w_hh.transpose(1, 2)
        gates = gx + (torch.bmm(h, wt) if b_hh is None else torch.baddbmm(b_hh.unsqueeze(1), h, wt))
        i, f, g, o = gates.chunk(4, dim=-1)
        assert c is not None
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c

    def forward(self, input: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self._forward(input, hx, has_cell=True)


class GRU(_RNNBase):
    """B ``nn.GRU`` layers (gate order r, z, n as in torch)."""

    def _cell(self, gx, h, c, w_hh, b_hh):
        wt = w_hh.transpose(1, 2)
        gh = torch.bmm(h, wt) if b_hh is None else torch.baddbmm(b_hh.unsqueeze(1), h, wt)
        xr, xz, xn = gx.chunk(3, dim=-1)
        hr, hz, hn = gh.chunk(3, dim=-1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        new = torch.tanh(xn + r * hn)
        return (1 - z) * new + z * h, None

    def forward(self, input: torch.Tensor, hx: torch.Tensor | None = None):
        return self._forward(input, hx, has_cell=False)
