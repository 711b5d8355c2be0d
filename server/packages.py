"""Code packages: a tenant's own workload, uploaded as a zip and run only by the workers.

A package is a zip named by its *digest*, the SHA-256 hex of its bytes, which the client
builds deterministically (``fusetune.client.package``): the same code always gives the same
digest, so a second study of it uploads nothing. Its root holds the manifest
``fusetune.json`` (:class:`Manifest`): where the workload is (``entry``, a ``module:attr``
inside the package, or ``pickle``, a cloudpickled Workload), the workload's metadata as plain
data, its search space as static distributions, optional pip requirements and the Python
version it was packaged with.

The control plane never imports or unpickles anything of a package. It checks what it can
check as data (:func:`check_package`): the digest, the limits the operator sets (bytes,
entries, bytes unpacked: a zip bomb is refused from its declared sizes, and every entry is
read back no further than those, its CRC checked), safe entry names (relative, no ``..``, no
symlinks, nothing encrypted, no two entries unpacking onto one path) and the manifest, parsed by the models below.
It keeps the zip in the artifact store at ``packages/<digest>.zip`` (:func:`package_key`),
where every node reaches it, and records which tenant uploaded it in ``ft_packages``: a
tenant may use only the packages it uploaded itself, and the same bytes uploaded by two
tenants are one stored object with two rows. Workers run the code under Ray's
``runtime_env``, fetching the zip as :func:`runtime_env` says; the scheduling loop reads a
package's metadata with :func:`manifest`.
"""

from __future__ import annotations

import hashlib
import io
import re
import stat
import unicodedata
import zipfile
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import PureWindowsPath
from typing import Annotated, Any, Literal

from packaging.requirements import InvalidRequirement, Requirement
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from fusetune.server.db import Tenant
from fusetune.server.db.models import Package
from fusetune.server.distributions import Choice, SearchSpaceEntry
from fusetune.server.errors import Forbidden, Invalid, NotFound, TooLarge
from fusetune.server.schemas import DIGEST_PATTERN, MAX_SEARCH_SPACE_PARAMS, parse_search_space, training_choice_error
from fusetune.server.settings import Settings, artifact_uri
from fusetune.server.wire import NO_NUL_KEYS, NoNul, NoNulKeys
from fusetune.workers.optimization import OptionError, lr_scheduler_name, optimizer_name
from fusetune.workers.store import get_store

__all__ = [
    "DIGEST_PATTERN",
    "MANIFEST",
    "PERMISSION",
    "Checked",
    "Limits",
    "Manifest",
    "PackageOut",
    "WorkloadInfo",
    "check_package",
    "download",
    "for_study",
    "manifest",
    "owned",
    "package_key",
    "runtime_env",
    "tenant_with_code",
    "upload",
]

#: The manifest's name, at the zip's root.
MANIFEST = "fusetune.json"
#: Largest manifest read (its own limit: it is parsed in the control plane).
MAX_MANIFEST_BYTES = 1024 * 1024
#: The permission a tenant needs to upload code and run studies of it (``ft_tenants.code_upload``).
PERMISSION = "code_upload"
_CHUNK = 1 << 20
_MODULE_ATTR = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"

Name = Annotated[NoNul, Field(min_length=1, max_length=255)]
Direction = Literal["maximize", "minimize"]


class MetricInfo(BaseModel):
    """One metric a package's workload declares: its name, which way is better, what it measures."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Name
    direction: Direction
    of: Literal["outputs", "model"] = "outputs"


#: A workload's default optimizer or scheduler argument: a number, a string, a boolean or null,
#: or a list of them (``betas``, ``milestones``). The manifest is read from the zip, not through
#: the API's JSON checks: NaN, numbers past a double and a megabyte of nested lists are refused here.
DefaultArgument = Choice | Annotated[list[Choice], Field(max_length=1024)]


class WorkloadInfo(BaseModel):
    """A package's workload as plain data, read from its ``Workload`` by the client: what the
    service needs to check a study's objectives and show it, without importing anything."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Name
    metric_name: Name
    direction: Direction
    metrics: list[MetricInfo] = Field(min_length=1, max_length=64)
    batch_size: int = Field(64, gt=0, le=2**31 - 1)
    optimizer: str = Field("SGD", min_length=1, max_length=64)
    optimizer_defaults: Annotated[dict[str, DefaultArgument], NoNulKeys] = Field(
        default_factory=dict, max_length=64, json_schema_extra=NO_NUL_KEYS
    )
    lr_scheduler: str | None = Field(None, min_length=1, max_length=64)
    lr_scheduler_defaults: Annotated[dict[str, DefaultArgument], NoNulKeys] = Field(
        default_factory=dict, max_length=64, json_schema_extra=NO_NUL_KEYS
    )
    warmup_epochs: int = Field(0, ge=0, le=10_000)
    max_norm: float | None = Field(None, gt=0)
    amp: bool = False
    description: NoNul = Field("", max_length=10_000)

    @field_validator("optimizer", "lr_scheduler")
    @classmethod
    def _fused_class(cls, name: str | None, info: ValidationInfo) -> str | None:
        check = optimizer_name if info.field_name == "optimizer" else lr_scheduler_name
        if name is not None:
            try:
                check(name)
            except OptionError as exc:
                raise ValueError(str(exc)) from exc
        return name

    @model_validator(mode="after")
    def _metrics_are_named_once(self) -> WorkloadInfo:
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names):
            raise ValueError(f"metrics repeat a name: {names}")
        if self.metric_name not in names:
            raise ValueError(f"metric_name {self.metric_name!r} is not among the metrics {names}")
        return self

    def metric_named(self, name: str) -> MetricInfo:
        """The declared metric called ``name``; raises ``KeyError`` naming the known ones (as
        ``Workload.metric_named`` does)."""
        for metric in self.metrics:
            if metric.name == name:
                return metric
        known = ", ".join(m.name for m in self.metrics)
        raise KeyError(f"workload {self.name!r} has no metric {name!r}; it declares: {known}")


class Manifest(BaseModel):
    """``fusetune.json``: what a package holds and how its workload is found (format 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    format: Literal[1]
    entry: str | None = Field(None, max_length=512, pattern=_MODULE_ATTR, description="`module:attr` inside the package.")
    pickle: str | None = Field(None, min_length=1, max_length=255, description="A cloudpickled Workload in the package.")
    workload: WorkloadInfo
    search_space: Annotated[dict[str, SearchSpaceEntry], NoNulKeys] = Field(
        min_length=1, max_length=MAX_SEARCH_SPACE_PARAMS, json_schema_extra=NO_NUL_KEYS,
        description="The workload's search space as static distributions (Optuna's distribution JSON); "
        "a study of the package without a search_space of its own takes it, so it has the same cap.",
    )
    requirements: list[Annotated[NoNul, Field(min_length=1, max_length=512)]] = Field(default_factory=list, max_length=256)
    python: str = Field(pattern=r"^3\.[0-9]{1,2}$")

    @model_validator(mode="after")
    def _one_way_to_the_workload(self) -> Manifest:
        if (self.entry is None) == (self.pickle is None):
            raise ValueError("exactly one of entry and pickle names the workload")
        return self

    @field_validator("search_space")
    @classmethod
    def _distributions(cls, space: dict[str, str | dict[str, Any]]) -> dict[str, str | dict[str, Any]]:
        wrong = training_choice_error(parse_search_space(space))
        if wrong is not None:
            raise ValueError(f"search_space[{wrong[0][0]!r}]: {wrong[1]}")
        return space

    @field_validator("requirements")
    @classmethod
    def _pip_requirements(cls, lines: list[str]) -> list[str]:
        for line in lines:
            # A pip option (--index-url, -e, -r file) would change where and what pip installs.
            if line.lstrip().startswith("-") or "\n" in line or "\r" in line:
                raise ValueError(f"{line!r} is not a requirement (pip options are not taken)")
            try:
                requirement = Requirement(line)
            except InvalidRequirement as exc:
                raise ValueError(f"{line!r} is not a requirement: {exc}") from exc
            # A direct reference (name @ URL) has pip fetch from wherever the URL points, a
            # file on the node included, as an --index-url would: a name and versions only.
            if requirement.url is not None:
                raise ValueError(f"{line!r} is a direct reference (name @ URL): name a package and its versions")
        return lines

    def distributions(self) -> dict[str, Any]:
        return parse_search_space(self.search_space)


class PackageOut(BaseModel):
    """A code package as its tenant uploaded it (the zip is ``GET /api/v1/packages/{digest}``)."""

    model_config = ConfigDict(from_attributes=True)

    digest: str = Field(description="The SHA-256 of the zip's bytes, in lower-case hex.")
    tenant: str
    size_bytes: int
    files: int = Field(description="Files in the zip.")
    created_at: datetime


@dataclass(frozen=True)
class Checked:
    """A package that passed :func:`check_package`."""

    digest: str
    size_bytes: int
    files: int
    manifest: Manifest


@dataclass(frozen=True)
class Limits:
    max_bytes: int
    max_files: int
    max_unpacked_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(settings.package_max_bytes, settings.package_max_files, settings.package_max_unpacked_bytes)


def package_key(digest: str) -> str:
    """Where a package is in the artifact store."""
    return f"packages/{digest}.zip"


def runtime_env(settings: Settings, digest: str) -> dict[str, Any]:
    """The Ray ``runtime_env`` of a worker that runs the package: the zip as its
    ``working_dir`` (Ray unpacks it with its files at the root) and its pip requirements.

    A store every node reaches by URI (``s3://``, ``gs://``) is handed to Ray as it is. A
    local store is a path on this machine: its zip is copied into the Ray cluster's GCS
    (``workers.package.in_cluster``), from which every node fetches it through Ray, whether
    or not it shares this filesystem. Run in the Ray driver (the scheduling loop).
    """
    from fusetune.workers.package import in_cluster
    from fusetune.workers.package import runtime_env as env_of

    store = get_store(artifact_uri(settings))
    key = package_key(digest)
    location = store.location(key)
    if "://" in location and not location.startswith("file://"):
        scheme, rest = location.split("://", 1)
        uri = f"gs://{rest}" if scheme == "gcs" else location  # pyarrow says gcs, Ray gs
    else:

        def read() -> bytes:
            data = store.read(key)
            if data is None:
                raise NotFound(f"package {digest} does not exist")
            return data

        uri = in_cluster(digest, read)
    return env_of(uri, manifest(settings, digest).requirements)


def manifest(settings: Settings, digest: str) -> Manifest:
    """The manifest of the stored package ``digest`` (cached per process: a digest's bytes never change).

    Raises:
        NotFound: no package of that digest is stored.
    """
    return _stored_manifest(artifact_uri(settings), digest)


# Few: a manifest of up to its byte limit in nested JSON is tens of MB of Python objects, and
# reading one again from the store costs a zip's read.
@lru_cache(maxsize=16)
def _stored_manifest(store_uri: str, digest: str) -> Manifest:
    data = get_store(store_uri).read(package_key(digest))
    if data is None:
        raise NotFound(f"package {digest} does not exist")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return Manifest.model_validate_json(archive.read(MANIFEST))


def check_package(data: bytes, digest: str, limits: Limits) -> Checked:
    """``data`` checked as the package ``digest``, without importing or unpickling anything.

    Raises:
        Invalid: naming ``digest`` (the bytes' SHA-256 differs), the body (not a zip), an
            entry (an unsafe name, a symlink, one that does not read back) or the manifest's
            field (``["body", "fusetune.json", "workload", "metrics", 0, "direction"]``).
        TooLarge: naming the setting exceeded (bytes, files, bytes unpacked).
    """
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:
        raise Invalid("digest", f"the body's SHA-256 is {actual}, not the digest {digest} the path names", where="path")
    if len(data) > limits.max_bytes:
        raise TooLarge("FUSETUNE_PACKAGE_MAX_BYTES", f"the package is larger than {limits.max_bytes} bytes (FUSETUNE_PACKAGE_MAX_BYTES)")
    _check_directory(data, limits)
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except Exception as exc:  # BadZipFile, or what a broken central directory raises (ValueError, EOFError, ...)
        raise Invalid((), f"the body is not a zip file: {exc}") from exc
    with archive:
        files = _check_entries(archive.infolist(), limits)
        _read_back(archive)
        found = _manifest_of(archive)
    return Checked(digest=digest, size_bytes=len(data), files=files, manifest=found)


#: The most central-directory bytes per file FUSETUNE_PACKAGE_MAX_FILES allows (46 bytes of
#: header, then the entry's name and extra fields: ample for the paths a project has).
_DIRECTORY_BYTES_PER_FILE = 512


def _check_directory(data: bytes, limits: Limits) -> None:
    """The zip's end record, read before ``zipfile.ZipFile`` builds an object for every entry
    of the central directory: 1.4 million of them in 64 MiB took 700 MB of the server's
    memory before the entries could be counted. Its entry count may lie (``ZipFile`` walks
    the directory by its size), so the directory's size is bounded too."""
    try:
        end = zipfile._EndRecData(io.BytesIO(data))  # type: ignore[attr-defined]  # the end record's reader, private but stable since Python 2
    except OSError:
        end = None
    if end is None:
        raise Invalid((), "the body is not a zip file: it has no end of central directory record")
    entries, size = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]  # type: ignore[attr-defined]
    if entries > limits.max_files or size > limits.max_files * _DIRECTORY_BYTES_PER_FILE:
        raise TooLarge(
            "FUSETUNE_PACKAGE_MAX_FILES",
            f"the package's directory lists {entries} entries in {size} bytes, more than FUSETUNE_PACKAGE_MAX_FILES="
            f"{limits.max_files} entries take",
        )


def _check_entries(infos: list[zipfile.ZipInfo], limits: Limits) -> int:
    """The number of files among ``infos``, once every name is safe and the limits hold."""
    if len(infos) > limits.max_files:
        raise TooLarge(
            "FUSETUNE_PACKAGE_MAX_FILES",
            f"the package holds {len(infos)} entries, more than FUSETUNE_PACKAGE_MAX_FILES={limits.max_files}",
        )
    places = _Places()
    unpacked = 0
    for info in infos:
        problem = _entry_problem(info) or places.take(info)
        if problem is not None:
            raise Invalid((info.filename,), f"the package's entry {info.filename!r} is refused: {problem}")
        unpacked += info.file_size
        if unpacked > limits.max_unpacked_bytes:
            raise TooLarge(
                "FUSETUNE_PACKAGE_MAX_UNPACKED_BYTES",
                f"the package's files take more than FUSETUNE_PACKAGE_MAX_UNPACKED_BYTES={limits.max_unpacked_bytes} bytes unpacked",
            )
    return sum(1 for info in infos if not info.is_dir())


class _Places:
    """Where the entries unpack: two entries that would land on one path are refused.

    Not only the same name twice: a file and a folder of one name (``x`` and ``x/``, or ``x``
    and ``x/y``), and names that one filesystem keeps apart and another does not: case
    (``A.py``, ``a.py`` on macOS or Windows) and Unicode normalisation (``café`` composed or
    decomposed). Which of the two a worker's unpacking would keep is up to its filesystem.
    """

    def __init__(self) -> None:
        self.files: dict[str, str] = {}
        self.folders: dict[str, str] = {}  # named ones and the parents of every entry

    @staticmethod
    def _key(path: str) -> str:
        # Simple case mapping, as case-insensitive filesystems compare (APFS, NTFS): casefold()
        # would also merge "straße" and "strasse", which none of them does.
        return unicodedata.normalize("NFC", path).lower()

    def take(self, info: zipfile.ZipInfo) -> str | None:
        """Why ``info`` collides with an entry taken before, or None (then it is taken)."""
        parts = info.filename.rstrip("/").split("/")
        key = self._key("/".join(parts))
        if info.is_dir():
            if key in self.files:
                return f"it is a folder where the entry {self.files[key]!r} is a file"
            if self.folders.get(key, "").endswith("/"):  # named before, not only a parent
                return f"it is the folder {self.folders[key]!r} again"
        elif key in self.files:
            return f"it unpacks where the entry {self.files[key]!r} does (a name twice, or one differing only in case or Unicode form)"
        elif key in self.folders:
            return f"it is a file where {self.folders[key]!r} is a folder"
        for i in range(1, len(parts)):
            parent = self._key("/".join(parts[:i]))
            if parent in self.files:
                return f"its folder {'/'.join(parts[:i])!r} is the entry {self.files[parent]!r}, a file"
            self.folders.setdefault(parent, "/".join(parts[:i]))
        if info.is_dir():
            self.folders[key] = info.filename
        else:
            self.files[key] = info.filename
        return None


def _entry_problem(info: zipfile.ZipInfo) -> str | None:
    """Why an entry may not be unpacked on a worker, or None."""
    name = info.filename
    if not name or "\\" in name or re.search(r"[\x00-\x1f]", name):
        return "a name must be a non-empty relative path with '/' separators and no control characters"
    if name.startswith("/") or PureWindowsPath(name).drive or PureWindowsPath(name).is_absolute():
        return "an absolute path"
    if any(part in ("", ".", "..") for part in name.rstrip("/").split("/")):
        return "a path must be relative, without '.', '..' or empty parts"
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
        return "not a plain file or folder"
    if info.flag_bits & 0x1:
        return "encrypted"
    return None


def _read_back(archive: zipfile.ZipFile) -> None:
    """Read every file through, no further than its declared size (zipfile stops there), its
    CRC checked: a zip bomb that lies about its sizes, or a corrupt entry, fails here."""
    for info in archive.infolist():
        if info.is_dir():
            continue
        try:
            with archive.open(info) as entry:
                while entry.read(_CHUNK):
                    pass
        except Exception as exc:  # BadZipFile (CRC), zlib/lzma errors, an unsupported method, a password
            raise Invalid((info.filename,), f"the package's entry {info.filename!r} does not read back: {exc}") from exc


def _manifest_of(archive: zipfile.ZipFile) -> Manifest:
    try:
        info = archive.getinfo(MANIFEST)
    except KeyError as exc:
        raise Invalid((MANIFEST,), f"the package has no {MANIFEST} at its root") from exc
    if info.file_size > MAX_MANIFEST_BYTES:
        raise Invalid((MANIFEST,), f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        found = Manifest.model_validate_json(archive.read(info))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        raise Invalid((MANIFEST, *first["loc"]), f"{MANIFEST}: {first['msg']}") from exc
    if found.pickle is not None and found.pickle not in archive.namelist():
        raise Invalid((MANIFEST, "pickle"), f"{MANIFEST} names the pickle {found.pickle!r}, which the package does not hold")
    return found


def tenant_with_code(session: Session, name: str, as_tenant: str | None, *, where: str = "query") -> Tenant:
    """The tenant ``name`` (the caller's own, or any for the admin), which must hold ``code_upload``.

    Raises:
        Invalid: naming ``tenant`` when there is no such tenant (or it is another tenant's name).
        Forbidden: naming ``code_upload`` when the admin has not granted it.
    """
    tenant = session.get(Tenant, name) if as_tenant is None or name == as_tenant else None
    if tenant is None:
        raise Invalid("tenant", f"tenant {name!r} does not exist", where=where)
    if not tenant.code_upload:
        raise Forbidden(
            PERMISSION,
            f"tenant {name!r} may not upload or run code: the admin grants it ({PERMISSION}: "
            f"PATCH /api/v1/tenants/{name} {{\"{PERMISSION}\": true}}, or `fusetune tenants set-code-upload {name} on`)",
        )
    return tenant


def upload(
    session: Session, settings: Settings, digest: str, data: bytes, *, tenant: str, as_tenant: str | None
) -> tuple[PackageOut, bool]:
    """Store the package ``digest`` for ``tenant``: its record, and True when it was new to
    the tenant. An upload the tenant made before stores nothing (its bytes are those bytes);
    another tenant's upload of the same bytes adds only the tenant's row."""
    owner = tenant_with_code(session, tenant, as_tenant)
    actual = hashlib.sha256(data).hexdigest()
    if actual != digest:  # before the row's look-up: a body is checked whatever is stored
        raise Invalid("digest", f"the body's SHA-256 is {actual}, not the digest {digest} the path names", where="path")
    row = session.get(Package, (digest, owner.name))
    if row is not None:
        return PackageOut.model_validate(row), False
    checked = check_package(data, digest, Limits.of(settings))
    store = get_store(artifact_uri(settings))
    key = package_key(digest)
    if not store.exists(key):  # content-addressed: whoever stored it stored these bytes
        store.write(key, data)
    row = Package(digest=digest, tenant=owner.name, size_bytes=checked.size_bytes, files=checked.files)
    session.add(row)
    try:
        session.commit()
    except IntegrityError:  # the same tenant's concurrent upload of it committed first
        session.rollback()
        row = session.get(Package, (digest, owner.name))
        if row is None:
            raise
        return PackageOut.model_validate(row), False
    return PackageOut.model_validate(row), True


def owned(session: Session, digest: str, *, tenant: str | None = None, as_tenant: str | None = None) -> PackageOut:
    """The record of the package ``digest`` that ``as_tenant`` uploaded (the admin, None: any
    tenant's, or ``tenant``'s). NotFound otherwise, as for a package that does not exist."""
    query = select(Package).where(Package.digest == digest)
    for name in (as_tenant, tenant):
        if name is not None:
            query = query.where(Package.tenant == name)
    row = session.scalars(query.order_by(Package.created_at).limit(1)).first()
    if row is None:
        raise NotFound(f"package {digest} does not exist")
    return PackageOut.model_validate(row)


def download(session: Session, settings: Settings, digest: str, *, as_tenant: str | None) -> bytes:
    """The zip of a package the caller may use (NotFound otherwise)."""
    owned(session, digest, as_tenant=as_tenant)
    data = get_store(artifact_uri(settings)).read(package_key(digest))
    if data is None:
        raise NotFound(f"package {digest} is recorded but not in the artifact store")
    return data


def for_study(session: Session, settings: Settings, digest: str, tenant: str, as_tenant: str | None) -> Manifest:
    """The manifest of a new study's package: its tenant holds ``code_upload`` (Forbidden)
    and uploaded the package itself (Invalid naming ``package`` otherwise)."""
    tenant_with_code(session, tenant, as_tenant, where="body")
    if session.get(Package, (digest, tenant)) is None:
        raise Invalid("package", f"tenant {tenant!r} has uploaded no package {digest} (PUT /api/v1/packages/{digest} first)")
    try:
        return manifest(settings, digest)
    except NotFound as exc:
        raise Invalid("package", str(exc)) from exc

