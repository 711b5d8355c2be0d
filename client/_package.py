"""Packaging a user's own workload for the service: :func:`package`.

A workload defined anywhere in the user's code goes to the service as a *package*: a zip
holding the code and a manifest, ``fusetune.json``, at its root, named by its *digest* (the
SHA-256 of its bytes). The zip is built deterministically (entries sorted, fixed timestamps
and permissions), so the same code gives the same digest and a second study of it uploads
nothing. The workload is either

* a :class:`~fusetune.Workload` object, from a script, a notebook's ``__main__`` or a module
  of the user's project: cloudpickled *by value* into ``fusetune_workload.pkl`` (the user's
  own modules are registered with ``cloudpickle.register_pickle_by_value``; installed
  packages such as torch stay references, imported where it is unpickled); or
* a ``module:attr`` path inside ``code=DIR``: the folder zipped as Ray's ``runtime_env``
  zips a ``working_dir`` (``.git``, ``__pycache__``, ``*.pyc``, ``.venv`` and
  ``node_modules`` left out, and the caller's ``excludes``, gitignore patterns), with the
  manifest's ``entry`` naming the workload.

**The search space.** A workload's ``search_space(trial)`` is define-by-run Python, user code
like the rest. The service must not run user code in the control plane (the API and
scheduling process every tenant shares), and asking a worker to run it would put a Ray round
trip on every ask's path. So the client runs it here, at submit time, and states it as static
distributions in the manifest (:func:`static_search_space`): it runs the space on trials of
an in-memory Optuna study several times, with different samplers and seeds and with each
categorical choice and each range's ends fixed in turn, and refuses a space whose params or
distributions differ between runs (a conditional space), or that returns params it did not
suggest. Such a space runs where the user's own process asks: ``fusetune.client.optimize``.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import logging
import os
import site
import stat
import sys
import sysconfig
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, lru_cache
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import optuna

if TYPE_CHECKING:
    from fusetune.workers.workloads import Workload

__all__ = [
    "DEFAULT_EXCLUDES",
    "ConditionalSearchSpaceError",
    "Package",
    "package",
    "static_search_space",
    "workload_metadata",
]

MANIFEST = "fusetune.json"
PICKLE = "fusetune_workload.pkl"
#: Left out of a code folder, as Ray leaves them out of a ``working_dir`` (gitignore patterns).
DEFAULT_EXCLUDES = (".git", "__pycache__", "*.pyc", ".venv", "node_modules")
#: The service's default FUSETUNE_PACKAGE_MAX_BYTES: larger packages are refused here, before an upload.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: The service's default FUSETUNE_PACKAGE_MAX_UNPACKED_BYTES: most bytes of a package's files,
#: and so of a code folder read into one.
DEFAULT_MAX_UNPACKED_BYTES = 256 * 1024 * 1024
#: The service's default FUSETUNE_PACKAGE_MAX_FILES: most files in a package.
DEFAULT_MAX_FILES = 10_000
_TIMESTAMP = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say
_FILE_MODE = (stat.S_IFREG | 0o644) << 16
_MAX_CHOICES_PROBED = 32
_SEEDS = 4


class ConditionalSearchSpaceError(ValueError):
    """The workload's search space is not one static set of distributions."""


@dataclass(frozen=True)
class Package:
    """A packaged workload: the zip's bytes, its digest and its manifest."""

    digest: str
    data: bytes
    manifest: dict[str, Any]

    @property
    def workload_name(self) -> str:
        return str(self.manifest["workload"]["name"])


def package(
    workload: Workload | str,
    *,
    code: str | os.PathLike[str] | None = None,
    requirements: Sequence[str] | None = None,
    excludes: Sequence[str] | None = None,
    search_space: Mapping[str, optuna.distributions.BaseDistribution] | None = None,
    conditional: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES,
    max_files: int = DEFAULT_MAX_FILES,
) -> Package:
    """Package ``workload`` for the service (see the module docstring).

    Args:
        workload: a ``Workload`` object, or a ``module:attr`` path inside ``code``.
        code: a folder to ship (needed for a path; with an object, files its code reads).
        requirements: pip requirements the workers install for it.
        excludes: gitignore patterns left out of ``code``, besides :data:`DEFAULT_EXCLUDES`.
        search_space: the static distributions of the manifest; the workload's own space,
            run here, when omitted.
        conditional: accept a conditional space, stated as the union of what its runs
            suggested (``optimize`` does: its client asks, the service only trains).
        max_bytes: the largest zip made (the service's FUSETUNE_PACKAGE_MAX_BYTES).
        max_unpacked_bytes: the most bytes its files take (FUSETUNE_PACKAGE_MAX_UNPACKED_BYTES);
            a code folder is read no further.
        max_files: the most files it holds (FUSETUNE_PACKAGE_MAX_FILES).

    A path's module is imported anew from ``code`` on every call (the files as they are now,
    which the zip holds), while modules of ``code`` the process imported before stay as they were.

    Raises:
        ValueError: naming what cannot be packaged (a path without ``code``, a module or
            attribute not in it, a module of that name imported from elsewhere, a name clash,
            a package over a limit, naming its setting, metadata that is not JSON, a space
            that suggests nothing).
        ConditionalSearchSpaceError: the workload's space is conditional (use ``optimize``).
    """
    files: dict[str, bytes] = {}
    if code is not None:
        files.update(_folder(Path(code), [*DEFAULT_EXCLUDES, *(excludes or ())], max_unpacked_bytes, max_files))
        for reserved in (MANIFEST, PICKLE):
            if reserved in files:
                raise ValueError(f"{Path(code) / reserved} would clash with the package's own {reserved}; rename it or exclude it")
    if isinstance(workload, str):
        if code is None:
            raise ValueError(f"workload {workload!r} is a path: give code=DIR, the folder it is in")
        found, entry, pickled = _entry(workload, Path(code)), workload, None
    else:
        found, entry, pickled = _as_workload(workload), None, PICKLE
        files[PICKLE] = _pickle_by_value(found)
    _check_training(found)
    if search_space is None:
        search_space = static_search_space(found.search_space, union=conditional)
    if not search_space:
        raise ValueError(f"workload {found.name!r}: its search space suggests no params, and a study samples some")
    manifest = {
        "format": 1,
        "entry": entry,
        "pickle": pickled,
        "workload": workload_metadata(found),
        "search_space": {name: json.loads(optuna.distributions.distribution_to_json(d)) for name, d in search_space.items()},
        "requirements": list(requirements or ()),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    files[MANIFEST] = json.dumps(manifest, sort_keys=True, indent=1).encode()
    _check_size(len(files), sum(map(len, files.values())), max_unpacked_bytes, max_files)
    data = _zip(files)
    if len(data) > max_bytes:
        raise ValueError(
            f"the package is {len(data)} bytes, over the {max_bytes} the service takes (FUSETUNE_PACKAGE_MAX_BYTES): "
            "leave data and large files out with excludes=[...], and have datasets() read them where the workers run"
        )
    return Package(hashlib.sha256(data).hexdigest(), data, manifest)


def _zip(files: Mapping[str, bytes]) -> bytes:
    """A zip of ``files`` that depends on nothing but their names and bytes: sorted, one
    timestamp, one mode, deflated at one level."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_TIMESTAMP)
            info.external_attr = _FILE_MODE
            info.create_system = 3  # Unix: the mode above is read as one
            archive.writestr(info, files[name], compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
    return buffer.getvalue()


def _check_size(count: int, size: int, max_unpacked_bytes: int, max_files: int, where: str = "the package") -> None:
    """Raise ValueError naming the service's setting that ``count`` files of ``size`` bytes exceed."""
    if count > max_files:
        raise ValueError(
            f"{where} holds more than {max_files} files, the most the service takes (FUSETUNE_PACKAGE_MAX_FILES): "
            "leave files out with excludes=[...]"
        )
    if size > max_unpacked_bytes:
        raise ValueError(
            f"{where} holds more than {max_unpacked_bytes} bytes, the most the service unpacks "
            "(FUSETUNE_PACKAGE_MAX_UNPACKED_BYTES): leave data and large files out with excludes=[...], "
            "and have datasets() read them where the workers run"
        )


def _folder(root: Path, excludes: Sequence[str], max_unpacked_bytes: int, max_files: int) -> dict[str, bytes]:
    """The files under ``root`` by their relative POSIX paths, less what ``excludes`` match
    (gitignore patterns, as git reads a ``.gitignore`` at the root); read no further than the limits."""
    import pathspec

    if not root.is_dir():
        raise ValueError(f"code={str(root)!r} is not a folder")
    spec = pathspec.GitIgnoreSpec.from_lines(excludes)
    files: dict[str, bytes] = {}
    total = 0
    for path in _walk(root, spec):
        total += path.stat().st_size
        _check_size(len(files) + 1, total, max_unpacked_bytes, max_files, where=f"code={str(root)!r}")  # before reading it
        files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files


def _walk(root: Path, spec: Any) -> Iterator[Path]:
    """The files under ``root`` that no exclude matches. Symlinks are followed, as Ray follows
    them in a ``working_dir`` (a ``data/`` linked in is uploaded): a link to a folder above it,
    or to one already walked, is not walked again, so a loop ends."""
    walked = {os.path.realpath(root)}
    for folder, dirs, names in os.walk(root, followlinks=True):
        here = Path(folder)
        kept = []
        for d in sorted(dirs):
            if spec.match_file((here / d).relative_to(root).as_posix() + "/"):
                continue
            real = os.path.realpath(here / d)
            if real in walked or any(os.path.commonpath([real, w]) == real for w in walked):
                continue  # an ancestor of a walked folder (a loop), or the same one linked twice
            walked.add(real)
            kept.append(d)
        dirs[:] = kept
        for name in sorted(names):
            path = here / name
            if not spec.match_file(path.relative_to(root).as_posix()) and path.is_file():
                yield path


def _entry(path: str, code: Path) -> Workload:
    """The workload at ``module:attr`` inside ``code``, imported here to read its metadata and space.

    The module is imported anew from the files as they are now (the zip holds them), not taken
    from ``sys.modules``: a notebook that edited it since its last import gets the manifest of
    its edit. The modules of ``code`` the process had imported are put back afterwards, so its
    own objects keep their classes; those imported for the first time stay imported.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"workload {path!r} is not a 'module:attr' path")
    root = os.path.realpath(code)
    with _fresh_imports(root):
        elsewhere = _imported_elsewhere(module_name, root)
        if elsewhere is not None:
            raise ValueError(f"module {elsewhere[0]!r} is imported from {elsewhere[1]}, not from code={str(code)!r}: rename it in code")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise  # the module's own import of something missing: its message says what
            raise ValueError(f"workload {path!r}: there is no module {exc.name!r} in code={str(code)!r}") from exc
    if not _under(module, root):
        where = getattr(module, "__file__", None)
        raise ValueError(f"module {module_name!r} is imported from {where or 'elsewhere'}, not from code={str(code)!r}: rename it")
    found: Any = module
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError as exc:
            raise ValueError(f"workload {path!r}: module {module_name!r} in code={str(code)!r} has no {attr!r}") from exc
    return _as_workload(found)


def _under(module: object, root: str) -> bool:
    """Whether ``module`` was imported from a file under the folder ``root`` (a real path)."""
    try:
        where = getattr(module, "__file__", None)
        paths = [] if where else list(getattr(module, "__path__", None) or ())  # a namespace package: its folders
    except Exception:  # a lazy module's __getattr__ may raise what it likes
        return False
    if where:
        return os.path.realpath(where).startswith(root + os.sep)
    return bool(paths) and all(os.path.realpath(p).startswith(root + os.sep) for p in paths)


def _imported_elsewhere(module_name: str, root: str) -> tuple[str, str] | None:
    """``module_name``, or a package above it, and where it is from, when the process imported
    it from outside ``root``: an import would find that one, not the one the workers get."""
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        module = sys.modules.get(name)
        if module is not None and not _under(module, root):
            return name, getattr(module, "__file__", None) or "elsewhere"
    return None


@contextmanager
def _fresh_imports(root: str) -> Iterator[None]:
    """Imports inside read the modules of ``root`` from its files (``root`` first on ``sys.path``);
    afterwards the modules of ``root`` imported before are back in ``sys.modules``."""
    before = {
        name: module for name, module in list(sys.modules.items())
        if name not in ("__main__", "__mp_main__") and module is not None and _under(module, root)
    }
    for name in before:
        del sys.modules[name]
    sys.path.insert(0, root)
    importlib.invalidate_caches()  # files written since the last import of the folder
    try:
        yield
    finally:
        sys.path.remove(root)
        sys.modules.update(before)


def _as_workload(obj: object) -> Workload:
    from fusetune.workers.workloads import Workload

    if not isinstance(obj, Workload):
        raise TypeError(f"{obj!r} is a {type(obj).__name__}, not a fusetune Workload")
    return obj


def _check_training(workload: Workload) -> None:
    """The workload's optimizer and scheduler defaults, checked here as the service checks a
    study's: a misspelt argument is refused before upload, naming it, not in every trial."""
    from fusetune.workers.optimization import OptionError, check_lr_scheduler_spec, check_optimizer_spec

    try:
        check_optimizer_spec(workload.optimizer, workload.optimizer_defaults, where="optimizer_defaults")
        if workload.lr_scheduler is not None:
            check_lr_scheduler_spec(workload.lr_scheduler, workload.lr_scheduler_defaults, where="lr_scheduler_defaults")
    except OptionError as exc:
        raise ValueError(f"workload {workload.name!r}: {exc}") from None


def _json(value: Any, field: str) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the workload's {field} is not plain JSON data: {exc}") from exc


def workload_metadata(workload: Workload) -> dict[str, Any]:
    """What the service knows of a workload without importing it: names, directions, defaults."""
    return {
        "name": workload.name,
        "metric_name": workload.metric_name,
        "direction": workload.direction,
        "metrics": [{"name": m.name, "direction": m.direction, "of": m.of} for m in workload.metrics],
        "batch_size": int(workload.batch_size),
        "optimizer": workload.optimizer,
        "optimizer_defaults": _json(dict(workload.optimizer_defaults), "optimizer_defaults"),
        "lr_scheduler": workload.lr_scheduler,
        "lr_scheduler_defaults": _json(dict(workload.lr_scheduler_defaults), "lr_scheduler_defaults"),
        "warmup_epochs": int(workload.warmup_epochs),
        "max_norm": None if workload.max_norm is None else float(workload.max_norm),
        "amp": bool(workload.amp),
        "description": workload.description,
    }


# -- pickling by value ---------------------------------------------------------------------


def _pickle_by_value(workload: Workload) -> bytes:
    """``cloudpickle.dumps(workload)`` with the user's own modules pickled by value (their code
    travels in the pickle; the workers have no copy of it), installed packages by reference."""
    import cloudpickle

    registered = cloudpickle.list_registry_pickle_by_value()
    added: list[str] = []
    for name, module in list(sys.modules.items()):
        if _is_users(name, module) and not any(name == r or name.startswith(r + ".") for r in registered | set(added)):
            cloudpickle.register_pickle_by_value(module)
            added.append(name)
    try:
        try:
            return cloudpickle.dumps(workload)
        except Exception as exc:  # a lock, an open file, a connection the workload's functions hold
            raise TypeError(f"workload {workload.name!r} cannot be sent by value: {_unpicklable(workload)}{exc}") from exc
    finally:
        for name in added:
            cloudpickle.unregister_pickle_by_value(sys.modules[name])


def _unpicklable(workload: Workload) -> str:
    """Which of the workload's fields holds what cloudpickle cannot pickle (``"its datasets: "``)."""
    import dataclasses

    import cloudpickle

    for f in dataclasses.fields(workload):
        try:
            cloudpickle.dumps(getattr(workload, f.name))
        except Exception:
            return (
                f"its {f.name} holds what cannot be pickled (build such things inside the function, "
                "or send the workload as a folder: code=DIR with a module:attr path): "
            )
    return ""


def _is_users(name: str, module: ModuleType | None) -> bool:
    """Whether ``module`` is the user's own code: a file outside the standard library and the
    site-packages, of no installed distribution but an editable one, and not fusetune (which
    every worker has). ``__main__`` is pickled by value by cloudpickle itself."""
    top = name.split(".")[0]
    if module is None or name == "__main__" or top == "fusetune":
        return False
    where = getattr(module, "__file__", None)
    if not where:
        return False
    path = os.path.realpath(where)
    if any(path.startswith(root + os.sep) for root in _installed_roots()):
        return False
    return all(_editable(dist) for dist in _distributions().get(top, ()))


@lru_cache(maxsize=1)
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple(sorted({os.path.realpath(r) for r in roots}))


@lru_cache(maxsize=1)
def _distributions() -> Mapping[str, list[str]]:
    return metadata.packages_distributions()


@cache
def _editable(distribution: str) -> bool:
    try:
        found = metadata.distribution(distribution).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return False
    return bool(found and json.loads(found).get("dir_info", {}).get("editable"))


# -- the search space ------------------------------------------------------------------------


def static_search_space(
    search_space: Callable[[optuna.Trial], Mapping[str, Any]], *, union: bool = False
) -> dict[str, optuna.distributions.BaseDistribution]:
    """The distributions a define-by-run ``search_space(trial)`` suggests, when they are one
    static set (see the module docstring for how and why).

    ``union``: a conditional space is stated as the union of what its runs suggested (a param
    suggested with two distributions is still refused).

    Raises:
        ConditionalSearchSpaceError: runs suggested different params or distributions, or the
            space returns params it did not suggest.
    """
    logger = logging.getLogger("optuna")
    level = logger.level
    logger.setLevel(logging.WARNING)  # each in-memory study would log its creation
    try:
        reference = _run(search_space, optuna.samplers.RandomSampler(seed=0), None)
        seen = dict(reference)
        for sampler, fixed in _probes(reference):
            found = _run(search_space, sampler, fixed)
            clash = sorted(k for k in found.keys() & seen.keys() if found[k] != seen[k])
            if clash or (found != reference and not union):
                differs = sorted(set(found) ^ set(reference)) or clash or sorted(k for k in found if found[k] != reference.get(k))
                raise ConditionalSearchSpaceError(
                    f"the workload's search space is conditional: its runs suggest different params or distributions "
                    f"({', '.join(differs)}). The service takes a static space, stated when the study is submitted "
                    "(tenant code never runs in the control plane). Run it with fusetune.client.optimize(study, workload, "
                    "...), which runs the space in your own process, or give search_space={...} as fixed distributions."
                )
            seen.update(found)
    finally:
        logger.setLevel(level)
    return seen


def _probes(reference: Mapping[str, optuna.distributions.BaseDistribution]) -> Iterator[tuple[optuna.samplers.BaseSampler, dict[str, Any] | None]]:
    """The runs after the first: other seeds and samplers, then each categorical choice and
    each range's ends fixed in turn (the branches a conditional space takes on them)."""
    for seed in range(1, _SEEDS + 1):
        yield optuna.samplers.RandomSampler(seed=seed), None
        yield optuna.samplers.TPESampler(seed=seed), None
    for name, distribution in reference.items():
        if isinstance(distribution, optuna.distributions.CategoricalDistribution):
            values = list(distribution.choices)[:_MAX_CHOICES_PROBED]
        else:
            values = [distribution.low, distribution.high]  # type: ignore[attr-defined]
        for value in values:
            yield optuna.samplers.RandomSampler(seed=0), {name: value}


def _run(
    search_space: Callable[[optuna.Trial], Mapping[str, Any]],
    sampler: optuna.samplers.BaseSampler,
    fixed: dict[str, Any] | None,
) -> dict[str, optuna.distributions.BaseDistribution]:
    study = optuna.create_study(sampler=sampler)
    if fixed is not None:
        study.enqueue_trial(fixed)
    trial = study.ask()
    returned = search_space(trial)
    if not isinstance(returned, Mapping) or dict(returned) != trial.params:
        extra = sorted(set(returned) - set(trial.params)) if isinstance(returned, Mapping) else []
        raise ConditionalSearchSpaceError(
            "the workload's search_space returns params it does not suggest, or other values than it suggests "
            f"({', '.join(map(str, extra)) or 'its return value'}): each trial trains with the params its space suggests "
            "(trial.params), in create_study and optimize alike. Derive such values (a constant, a product of two params) "
            "in build_model instead."
        )
    return dict(trial.distributions)
