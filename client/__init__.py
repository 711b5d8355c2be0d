"""Python client of the fusetune service."""

from ._client import Client, FusetuneError

__all__ = ["Client", "FusetuneError"]
