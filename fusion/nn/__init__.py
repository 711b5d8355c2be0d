"""Fused twins of ``torch.nn`` layers and the registry that maps one to the other.

Only layers that own parameters, buffers or per-member settings need a twin;
every parameter-free layer (activations, pooling, Flatten, Identity, ...)
runs unchanged on the member-folded batch. MaxPool2d has a twin for speed only
(torch's CPU kernel is faster in channels-last memory; same results).
"""

from __future__ import annotations

from torch import nn

from ._activation import PReLU
from ._attention import MultiheadAttention, pin_composable_paths
from ._base import FusedLayer
from ._conv import Conv, ConvTranspose
from ._dropout import Dropout
from ._embedding import Embedding
from ._linear import Bilinear, Linear
from ._norm import BatchNorm, GroupNorm, InstanceNorm, LayerNorm
from ._pool import MaxPool2d
from ._rnn import GRU, LSTM

#: torch layer type -> fused twin type. Looked up by exact type so that a user
#: subclass with a custom forward is never silently replaced.
TWINS: dict[type[nn.Module], type[FusedLayer]] = {
    nn.Linear: Linear,
    nn.Bilinear: Bilinear,
    nn.Conv1d: Conv,
    nn.Conv2d: Conv,
    nn.Conv3d: Conv,
    nn.ConvTranspose1d: ConvTranspose,
    nn.ConvTranspose2d: ConvTranspose,
    nn.ConvTranspose3d: ConvTranspose,
    nn.BatchNorm1d: BatchNorm,
    nn.BatchNorm2d: BatchNorm,
    nn.BatchNorm3d: BatchNorm,
    nn.LayerNorm: LayerNorm,
    nn.GroupNorm: GroupNorm,
    nn.InstanceNorm1d: InstanceNorm,
    nn.InstanceNorm2d: InstanceNorm,
    nn.InstanceNorm3d: InstanceNorm,
    nn.Embedding: Embedding,
    nn.Dropout: Dropout,
    nn.Dropout1d: Dropout,
    nn.Dropout2d: Dropout,
    nn.Dropout3d: Dropout,
    nn.MultiheadAttention: MultiheadAttention,
    nn.PReLU: PReLU,
    nn.MaxPool2d: MaxPool2d,
    nn.LSTM: LSTM,
    nn.GRU: GRU,
}

__all__ = [
    "TWINS",
    "BatchNorm",
    "Bilinear",
    "Conv",
    "ConvTranspose",
    "Dropout",
    "Embedding",
    "FusedLayer",
    "GRU",
    "LSTM",
    "MaxPool2d",
    "MultiheadAttention",
    "PReLU",
    "pin_composable_paths",
    "GroupNorm",
    "InstanceNorm",
    "LayerNorm",
    "Linear",
]
