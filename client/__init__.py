"""Python client of the fusetune service."""

from ._client import Client, FusetuneError
from .samplers import FusionSampler

__all__ = ["Client", "FusetuneError", "FusionSampler"]
