"""The artifact store: where workers keep checkpoints and finished members' weights.

A local directory by default, or any URI ``pyarrow.fs`` understands (``file:///shared/fusetune``
on a filesystem every node mounts, ``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``), as
Ray's own ``storage_path`` is. Every node of a cluster must see the same store: a member
checkpointed on one node resumes on another, and the weights a trial ends with are read back
from wherever the user is. The control plane never looks into the store; it learns of
checkpoints from the workers' reports (``workers.spec.MemberReport.checkpoint_epoch``).

Keys are ``/``-separated paths under the store's root, e.g. ``<study>/checkpoints/trial-3.pt``.

A write is whole and durable once :meth:`ArtifactStore.write` returns, so a worker may report
what it wrote (a checkpoint the control plane will resume from) as soon as the call is back:

* a local filesystem (a plain path, or ``file://``): the bytes go to a temporary file beside
  the target, which is flushed and ``fsync``-ed, renamed over the target (``os.replace``:
  readers see the old file or the new one), and the folder is ``fsync``-ed so that the rename
  itself survives a power loss (where the filesystem can sync a folder; some network
  filesystems cannot, and say so with ``EINVAL``: their own close-to-open semantics apply);
* object stores (``s3://``, ``gs://``): one upload. The object becomes visible only once its
  upload completed (a multipart upload at its completion), and the store acknowledges an
  upload only after it stored the object redundantly; reads after that see it (S3 and GCS
  are strongly consistent). There are no renames, and none is needed;
* any other ``pyarrow.fs`` filesystem (``hdfs://``, ``mock://``, fsspec wrappers): a
  temporary file, closed, then moved over the target. On HDFS the close returns once every
  DataNode of the pipeline has acknowledged the blocks (held in their memory; on disk only
  with ``dfs.datanode.synconclose``) and the rename is atomic and logged by the NameNode.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch

__all__ = ["ArtifactStore", "get_store"]

#: pyarrow.fs filesystems whose uploads are atomic: an object appears whole when its upload
#: completes and never before, so a write needs no temporary object (nor a copy to rename it).
ATOMIC_UPLOADS = frozenset({"s3", "gcs"})


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
        """Write ``data`` at ``key`` as a whole and durably: a reader sees the old object or the
        new one, never half, and once this returns the new one survives a crash (the module
        docstring says how, per kind of filesystem)."""
        path = self._path(key)
        if self.local:
            _write_local(path, data)
            return
        parent = path.rsplit("/", 1)[0]
        if parent:
            self.fs.create_dir(parent, recursive=True)
        target = path if self.fs.type_name in ATOMIC_UPLOADS else f"{path}.tmp-{uuid.uuid4().hex[:8]}"
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


def _write_local(path: str, data: bytes) -> None:
    """Temporary file, flush, fsync, rename over ``path``, fsync the folder (module docstring)."""
    folder = os.path.dirname(path)
    _make_dirs(folder)
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    # 0o666 less the umask, as the files pyarrow wrote before: every node's workers read them.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())  # the bytes are on disk before the name points at them
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_dir(folder)  # the rename itself


def _make_dirs(folder: str) -> None:
    """``os.makedirs``, each new folder's entry synced in its parent: a checkpoint whose folder
    was created just before it would otherwise be lost with the folder's entry."""
    missing = []
    at = folder
    while at and not os.path.isdir(at):
        missing.append(at)
        parent = os.path.dirname(at)
        if parent == at:
            break
        at = parent
    if not missing:
        return
    os.makedirs(folder, exist_ok=True)
    for created in reversed(missing):
        _fsync_dir(os.path.dirname(created))


def _fsync_dir(folder: str) -> None:
    """``fsync`` a folder (its entries: a rename, a new file); a no-op where the filesystem or
    the platform cannot sync one (EINVAL, ENOTSUP, or no O_DIRECTORY, as on Windows)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


@lru_cache(maxsize=16)
def get_store(uri: str) -> ArtifactStore:
    """One :class:`ArtifactStore` per URI and process (object stores resolve credentials once)."""
    return ArtifactStore(uri)
