"""Exception type raised for everything the fusion engine refuses to do."""

from __future__ import annotations


class FusionError(ValueError):
    """A model, input or setting that the fusion engine cannot fuse or handle.

    Subclasses :class:`ValueError` so that callers validating user supplied
    configurations can catch both with one ``except`` clause.
    """


class UnsupportedByTwin(FusionError):
    """A layer configuration its fused twin does not support but torch's own layer runs
    (InstanceNorm with running statistics, an LSTM projection): the batched path runs it."""


class FusionWarning(UserWarning):
    """Something the engine handles correctly but without the speed of fusion."""
