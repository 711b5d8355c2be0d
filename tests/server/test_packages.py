"""Code packages over HTTP: PUT/HEAD/GET /api/v1/packages/{digest} and studies that name one.

A package is data to the control plane: every check here is made without importing or
unpickling anything (nothing in these packages would import: their modules do not exist).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import stat
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveApi, live_api

SPACE = {"lr": {"name": "FloatDistribution", "attributes": {"low": 0.01, "high": 0.1, "log": False, "step": None}}}
WORKLOAD = {
    "name": "my-net", "metric_name": "accuracy", "direction": "maximize",
    "metrics": [{"name": "accuracy", "direction": "maximize", "of": "outputs"}, {"name": "loss", "direction": "minimize", "of": "outputs"}],
}


def manifest(**changes: Any) -> dict[str, Any]:
    return {"format": 1, "entry": "my_net:WORKLOAD", "pickle": None, "workload": WORKLOAD, "search_space": SPACE,
            "requirements": [], "python": "3.11", **changes}


def zipped(files: Mapping[str, bytes], modes: Mapping[str, int] | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = ((modes or {}).get(name, stat.S_IFREG | 0o644)) << 16
            archive.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def package(**changes: Any) -> bytes:
    return zipped({"fusetune.json": json.dumps(manifest(**changes)).encode(), "my_net.py": b"raise SystemExit('never run here')\n"})


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(client: httpx.Client, data: bytes, name: str | None = None, **params: str) -> httpx.Response:
    return client.put(f"/api/v1/packages/{name or digest(data)}", content=data, headers={"Content-Type": "application/zip"}, params=params)


@pytest.fixture
def small(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    """The API with small package limits (each exceeded below) and a tenant allowed to upload."""
    yield from live_api(
        database_url, artifact_dir=tmp_path_factory.mktemp("artifacts"),
        package_max_bytes=4096, package_max_files=4, package_max_unpacked_bytes=8192,
    )


@pytest.fixture
def uploader(small: LiveApi) -> httpx.Client:
    _, token = small.create_tenant("lab", code_upload=True)
    return small.client(token)


def test_a_tenant_without_the_grant_is_refused_before_its_body_is_read(small: LiveApi) -> None:
    """Its connection cannot have the server hold a package's worth of body: the 403 comes
    while the body it announced has not been sent."""
    import socket
    from urllib.parse import urlsplit

    _, token = small.create_tenant("plain")
    where = urlsplit(small.url)
    with socket.create_connection((where.hostname, where.port), timeout=60) as sock:
        sock.sendall(
            f"PUT /api/v1/packages/{'0' * 64} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/zip\r\nContent-Length: 4000\r\n\r\nPK".encode()
        )
        answer = b""
        while b"code_upload" not in answer:  # waits for the answer, never for a duration
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 403"), answer
    assert b"code_upload" in answer


def test_uploading_code_takes_the_admins_grant(small: LiveApi) -> None:
    _, token = small.create_tenant("plain")
    refused = put(small.client(token), package())
    assert refused.status_code == 403 and "code_upload" in refused.json()["detail"]
    granted = small.client(small.admin_token).patch("/api/v1/tenants/plain", json={"code_upload": True})
    assert granted.status_code == 200 and granted.json()["code_upload"] is True
    assert put(small.client(token), package()).status_code == 201


def test_the_same_bytes_are_stored_once_and_read_back(uploader: httpx.Client, small: LiveApi) -> None:
    data = package()
    assert uploader.head(f"/api/v1/packages/{digest(data)}").status_code == 404
    first = put(uploader, data)
    assert first.status_code == 201 and first.json()["digest"] == digest(data)
    again = put(uploader, data)
    assert again.status_code == 200  # had it: nothing stored again
    assert uploader.head(f"/api/v1/packages/{digest(data)}").status_code == 200
    got = uploader.get(f"/api/v1/packages/{digest(data)}")
    assert got.status_code == 200 and got.content == data


@pytest.mark.parametrize(
    ("data", "setting"),
    [
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "blob.bin": random.Random(0).randbytes(5000)}), "FUSETUNE_PACKAGE_MAX_BYTES"),
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), **{f"m{i}.py": b"" for i in range(4)}}), "FUSETUNE_PACKAGE_MAX_FILES"),
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "zeros.bin": bytes(9000)}), "FUSETUNE_PACKAGE_MAX_UNPACKED_BYTES"),
    ],
    ids=["bytes", "files", "unpacked"],
)
def test_a_package_over_a_limit_is_a_413_naming_the_setting(uploader: httpx.Client, data: bytes, setting: str) -> None:
    response = put(uploader, data)
    assert response.status_code == 413 and setting in response.json()["detail"], response.text


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "../escape.py": b""}), "../escape.py"),
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "/etc/cron.d/x": b""}), "/etc/cron.d/x"),
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "link": b"/etc/passwd"}, {"link": stat.S_IFLNK | 0o777}), "link"),
        (zipped({"my_net.py": b""}), "fusetune.json"),
        (package(entry=None), "pickle"),
        (package(requirements=["--index-url=http://evil"]), "requirements"),
        (package(requirements=["einops @ file:///etc/passwd"]), "direct reference"),
        (package(requirements=["einops @ https://evil.example/einops.whl"]), "direct reference"),
        (package(search_space={}), "search_space"),
        (package(workload={**WORKLOAD, "metric_name": "f1"}), "metric_name"),
        (b"not a zip at all", "zip"),
        # Two entries that unpack onto one path: which one a worker keeps is its filesystem's choice.
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "x": b"", "x/": b""}), "a folder where the entry 'x' is a file"),
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "x": b"", "x/y.py": b""}), "its folder 'x' is the entry 'x'"),
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "Net.py": b"", "net.py": b""}), "differing only in case"),
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "caf\u00e9.py": b"", "cafe\u0301.py": b""}), "Unicode form"),
        (zipped({"fusetune.json": json.dumps(manifest()).encode(), "fusetune.json/": b""}), "fusetune.json/"),
        # Defaults are scalars or lists of them: a small zip of nested lists was 24 MB held per manifest.
        (package(workload={**WORKLOAD, "optimizer_defaults": {"x": [[]] * 100}}), "optimizer_defaults"),
        (package(workload={**WORKLOAD, "lr_scheduler_defaults": {"gamma": float("nan")}}), "lr_scheduler_defaults"),
        (package(workload={**WORKLOAD, "optimizer_defaults": {"lr": 10**400}}), "optimizer_defaults"),
    ],
    ids=[
        "dotdot", "absolute", "symlink", "no-manifest", "no-entry", "pip-option", "file-reference", "url-reference",
        "empty-space", "unknown-metric", "not-zip",
        "file-and-folder", "file-under-file", "case", "unicode-form", "manifest-folder", "nested-defaults", "nan-default",
        "huge-default",
    ],
)
def test_what_a_package_holds_is_checked_as_data_with_422s_naming_it(uploader: httpx.Client, data: bytes, named: str) -> None:
    response = put(uploader, data)
    assert response.status_code == 422, response.text
    assert named in json.dumps(response.json()), response.text


def test_the_digest_is_the_bodys_sha256(uploader: httpx.Client) -> None:
    data = package()
    response = put(uploader, data, name="0" * 64)
    assert response.status_code == 422 and "digest" in json.dumps(response.json())
    assert uploader.put(f"/api/v1/packages/{digest(data)}", content=data, headers={"Content-Type": "text/plain"}).status_code == 415


def test_a_study_of_a_package_shows_it_and_takes_its_manifests_space_and_metrics(uploader: httpx.Client, small: LiveApi) -> None:
    data = package()
    assert put(uploader, data).status_code == 201
    created = uploader.post("/api/v1/studies", json={"workload": "my-net", "package": digest(data), "n_trials": 2, "epochs": 1})
    assert created.status_code == 201, created.text
    study = created.json()
    assert study["package"] == digest(data) and study["package_url"] == f"/api/v1/packages/{digest(data)}"
    assert study["search_space"] == SPACE and study["metrics"] == ["accuracy"]
    wrong_name = uploader.post("/api/v1/studies", json={"workload": "other-net", "package": digest(data), "n_trials": 1})
    assert wrong_name.status_code == 422 and "workload" in json.dumps(wrong_name.json())
    wrong_metric = uploader.post("/api/v1/studies", json={"workload": "my-net", "package": digest(data), "n_trials": 1, "metrics": ["f1"]})
    assert wrong_metric.status_code == 422 and "metrics" in json.dumps(wrong_metric.json())


def test_a_tenant_runs_only_packages_it_uploaded(uploader: httpx.Client, small: LiveApi) -> None:
    data = package()
    assert put(uploader, data).status_code == 201
    _, token = small.create_tenant("rival", code_upload=True)
    rival = small.client(token)
    assert rival.get(f"/api/v1/packages/{digest(data)}").status_code == 404
    refused = rival.post("/api/v1/studies", json={"workload": "my-net", "package": digest(data), "n_trials": 1})
    assert refused.status_code in (404, 422) and "package" in json.dumps(refused.json()), refused.text


def test_a_manifests_space_has_a_studys_cap() -> None:
    """A study of a package without a search_space takes the manifest's: the same cap holds,
    or the scheduling loop would probe a space the study's own field refuses."""
    import pydantic

    from fusetune.server.packages import Manifest
    from fusetune.server.schemas import MAX_SEARCH_SPACE_PARAMS

    lr = SPACE["lr"]
    Manifest.model_validate(manifest(search_space={f"p{i}": lr for i in range(MAX_SEARCH_SPACE_PARAMS)}))
    with pytest.raises(pydantic.ValidationError) as refused:
        Manifest.model_validate(manifest(search_space={f"p{i}": lr for i in range(MAX_SEARCH_SPACE_PARAMS + 1)}))
    assert [e["loc"] for e in refused.value.errors()] == [("search_space",)]


def test_the_zip_directory_is_bounded_before_its_entries_are_read() -> None:
    """zipfile builds an object per central-directory entry (1.4 million in 64 MiB took 700 MB)
    before they can be counted: the end record's count and the directory's size are held
    against FUSETUNE_PACKAGE_MAX_FILES first, and a count that lies is caught by the size."""
    from fusetune.server.errors import TooLarge
    from fusetune.server.packages import Limits, check_package

    limits = Limits(max_bytes=10**6, max_files=2, max_unpacked_bytes=10**6)
    files = {"fusetune.json": json.dumps(manifest()).encode(), **{f"m{i}.py": b"" for i in range(3)}}
    honest = zipped(files)
    with pytest.raises(TooLarge, match="directory lists 4 entries") as refused:
        check_package(honest, digest(honest), limits)
    assert "FUSETUNE_PACKAGE_MAX_FILES" in str(refused.value)
    long_names = zipped({"fusetune.json": files["fusetune.json"], **{"d/" + "x" * 600 + f"{i}.py": b"" for i in range(2)}})
    lying = bytearray(long_names)
    end = lying.rindex(b"PK\x05\x06")
    lying[end + 8:end + 12] = (1).to_bytes(2, "little") * 2  # "1 entry", on this disk and in all
    with pytest.raises(TooLarge, match="directory lists 1 entries in"):
        check_package(bytes(lying), digest(bytes(lying)), limits)
