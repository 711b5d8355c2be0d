"""The artifact store: where workers keep checkpoints and finished members' weights.

A local directory by default, or any URI ``pyarrow.fs`` understands (``file:///shared/fusetune``
on a filesystem every node mounts, ``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``), as
Ray's own ``storage_path`` is. Every node of a cluster must see the same store: a member
checkpointed on one node resumes on another, and the weights a trial ends with are read back
from wherever the user is. The control plane never looks into the store; it learns of
checkpoints from the workers' reports (``workers.spec.MemberReport.checkpoint_epoch``).

Keys are ``/``-separated paths under the store's root, e.g. ``<study>/checkpoints/trial-3.pt``.
"""

from __future__ import annotations

import io
import os
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch

__all__ = ["ArtifactStore", "get_store"]


class ArtifactStore:
    """One artifact store, by its URI or local path (see the module docstring)."""

    def __init__(self, uri: str | os.PathLike[str]) -> None:
        text = os.fspath(uri)
        if "://" not in text:  # a plain path: local, pinned to where the service started
            text = str(Path(text).resolve())
        self.uri = text
        self.fs, self.root = pafs.FileSystem.from_uri(text)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.root = self.root.rstrip("/") or "/"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key.lstrip('/')}"

    def location(self, key: str) -> str:
        """Where ``key`` is, for people: a local path, or the URI in the store's scheme."""
        if self.local and "://" not in self.uri:
            return self._path(key)
        scheme = self.uri.split("://", 1)[0]
        return f"{scheme}://{self._path(key).lstrip('/') if scheme != 'file' else self._path(key)}"

    def write(self, key: str, data: bytes) -> None:
        """Write ``data`` at ``key`` as a whole: a reader sees the old object or the new one, never half.

        Local filesystems write a temporary file and rename it; object stores make an object
        visible only once its upload is complete.
        """
        path = self._path(key)
        parent = path.rsplit("/", 1)[0]
        if parent:
            self.fs.create_dir(parent, recursive=True)
        target = f"{path}.tmp-{uuid.uuid4().hex[:8]}" if self.local else path
        with self.fs.open_output_stream(target) as out:
            out.write(data)
        if target != path:
            self.fs.move(target, path)

    def read(self, key: str) -> bytes | None:
        """The bytes at ``key``, or None when there is nothing there."""
        try:
            with self.fs.open_input_stream(self._path(key)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self.fs.get_file_info(self._path(key)).type == pafs.FileType.File

    def delete(self, key: str) -> None:
        try:
            self.fs.delete_file(self._path(key))
        except FileNotFoundError:
            pass

    def list(self, key: str) -> list[str]:
        """The names of the files directly under ``key`` (none when there is no such folder)."""
        infos = self.fs.get_file_info(pafs.FileSelector(self._path(key), allow_not_found=True))
        return [info.base_name for info in infos if info.type == pafs.FileType.File]

    def delete_dir(self, key: str) -> None:
        """Remove everything under ``key`` (a study's artifacts), if anything is there."""
        try:
            self.fs.delete_dir(self._path(key))
        except FileNotFoundError:
            pass

    def save_torch(self, key: str, obj: Any) -> str:
        """``torch.save`` ``obj`` at ``key``; returns its :meth:`location`."""
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        self.write(key, buffer.getvalue())
        return self.location(key)

    def load_torch(self, key: str) -> Any | None:
        """What :meth:`save_torch` saved at ``key`` (tensors on the CPU), or None."""
        data = self.read(key)
        if data is None:
            return None
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


@lru_cache(maxsize=16)
def get_store(uri: str) -> ArtifactStore:
    """One :class:`ArtifactStore` per URI and process (object stores resolve credentials once)."""
    return ArtifactStore(uri)
