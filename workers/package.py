"""A tenant's code package where its code may run: a Ray worker process whose ``runtime_env``
unpacked it.

A study of an uploaded workload (``server/packages.py``: a zip named by its SHA-256 digest,
with its manifest ``fusetune.json`` at the root) trains in actors started with the package as
their ``runtime_env`` ``working_dir``: Ray fetches and unpacks the zip on the actor's node
and starts the actor in that folder, so the code reaches every node through Ray, not
through a shared path. The control plane never imports it: it hands the actors plain data
(the package's digest, params, the study's settings), and they load the workload here.

Where the zip comes from (:func:`runtime_env`): a store every node reaches (``s3://``,
``gs://``) is Ray's URI as it is; a package in a local store is copied into the Ray
cluster's own object store (GCS) under a ``gcs://`` URI first, as Ray's job submission does
with a job's ``working_dir``. Ray drops an unreferenced GCS package after a while, so the
control plane checks it is there before each actor it starts (:func:`in_cluster`).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusetune.workers.workloads import Workload, get_workload

__all__ = ["GCS_PREFIX", "MANIFEST", "PackageError", "in_cluster", "package_workload", "runtime_env", "workload_of"]

MANIFEST = "fusetune.json"
#: The service's settings' environment variables (server/settings.py): never a package's.
SETTINGS_PREFIX = "FUSETUNE_"
#: A package's URI in the Ray cluster's GCS: Ray's own prefix for uploaded working dirs, so
#: its runtime-env agent treats it as one (reference counted, unpacked once per node).
GCS_PREFIX = "gcs://_ray_pkg_fusetune_"


class PackageError(RuntimeError):
    """A package's code could not be set up or loaded: its study fails with this (the traceback
    included), and no other study is touched."""


def gcs_uri(digest: str) -> str:
    return f"{GCS_PREFIX}{digest}.zip"


def in_cluster(digest: str, read: Callable[[], bytes]) -> str:
    """The ``gcs://`` URI of the package in the connected Ray cluster, copying its bytes
    (``read()``) there unless they are there already. Runs in the Ray driver."""
    # Ray's packaging module is what its job submission and `ray.init(runtime_env=...)` use
    # to push a working_dir; it has no public twin for pushing bytes that are not a folder.
    from ray._private.runtime_env.packaging import package_exists, upload_package_to_gcs

    uri = gcs_uri(digest)
    if not package_exists(uri):
        upload_package_to_gcs(uri, read())
    return uri


def runtime_env(uri: str, requirements: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The ``runtime_env`` of an actor that runs the package at ``uri``: its files as the
    working directory, and its pip requirements installed (by Ray, once per node and set).

    A Ray worker inherits its node's environment, and a node started beside the service (a
    local Ray, or the server's own node) has the service's settings in it: its database URL,
    its admin and metrics tokens. The package's processes get every ``FUSETUNE_*`` variable of
    this process blanked (workers take everything they need from the array's spec).
    """
    blanked = {name: "" for name in os.environ if name.startswith(SETTINGS_PREFIX)}
    env: dict[str, Any] = {"working_dir": uri, "env_vars": blanked}
    if requirements:
        env["pip"] = list(requirements)
    return env


_loaded: dict[str, Workload] = {}
_lock = threading.Lock()


def package_workload(digest: str) -> Workload:
    """The workload of the package ``digest``, loaded in this process from the folder Ray
    unpacked it to (the working directory): its ``entry`` imported, or its pickle loaded.

    Raises:
        PackageError: this process does not run that package, or its code failed to load
            (the message holds the traceback).
    """
    with _lock:
        if digest in _loaded:
            return _loaded[digest]
        here = Path.cwd()
        if digest not in here.name or not (here / MANIFEST).is_file():
            raise PackageError(f"this worker does not run package {digest} (its working directory is {here})")
        try:
            workload = _load(here, json.loads((here / MANIFEST).read_text()))
        except PackageError:
            raise
        except BaseException as exc:  # a module's own SystemExit or KeyboardInterrupt included
            raise PackageError(f"its code failed to load: {type(exc).__name__}: {exc}\n{traceback.format_exc()}") from None
        _loaded[digest] = workload
        return workload


def _load(here: Path, manifest: dict[str, Any]) -> Workload:
    if str(here) not in sys.path:  # Ray sets the working directory; imports start from it
        sys.path.insert(0, str(here))
    if manifest.get("entry"):
        module_name, _, attr = str(manifest["entry"]).partition(":")
        found: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            found = getattr(found, part)
    else:
        import cloudpickle

        found = cloudpickle.loads((here / str(manifest["pickle"])).read_bytes())
    if not isinstance(found, Workload):
        raise PackageError(f"the package's workload is a {type(found).__name__}, not a fusetune Workload")
    name = manifest.get("workload", {}).get("name")
    if found.name != name:
        raise PackageError(f"the package's workload is named {found.name!r}, and its manifest says {name!r}")
    return found


def workload_of(name: str, package: str | None) -> Workload:
    """A study's workload in a worker: its package's, or the registered one called ``name``."""
    return package_workload(package) if package else get_workload(name)

