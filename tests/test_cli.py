"""The `fusetune` command against a live API server."""

from __future__ import annotations

import io
import json
import os
import secrets
import sys
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusetune.client import Client, package
from fusetune.server.cli import BackgroundServer, main
from fusetune.server.settings import Settings
from tests.conftest import free_port


@dataclass
class Server:
    url: str
    database_url: str
    admin_token: str | None


def serve(database_url: str, admin_token: str | None, **settings: object) -> Iterator[Server]:
    config = Settings(database_url=database_url, port=free_port(), admin_token=admin_token, **settings)
    server = BackgroundServer(config, schedule=False).start()
    try:
        yield Server(server.url, database_url, admin_token)
    finally:
        server.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from serve(f"sqlite:///{tmp_path / 'cli.db'}", secrets.token_urlsafe(32), artifact_dir=tmp_path / "artifacts")


def create(server: Server, capsys: pytest.CaptureFixture[str], name: str, *args: str) -> dict:
    assert main(["tenants", "create", name, *args, "--url", server.url, f"--token={server.admin_token}"]) == 0
    out = capsys.readouterr()
    assert "shown only this once" in out.err
    return json.loads(out.out)


def test_submit_then_status(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token = create(server, capsys, "acme")["token"]["token"]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"workload": "digits-cnn", "n_trials": 3, "name": "from-cli"}))
    assert main(["submit", str(sweep), "--url", server.url, "--token", token]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["name"] == "from-cli" and created["n_trials"] == 3 and created["tenant"] == "acme"

    assert main(["status", "--url", server.url, "--token", token]) == 0
    assert "from-cli" in capsys.readouterr().out
    assert main(["status", str(created["id"]), "--url", server.url, "--token", token]) == 0
    assert f"study {created['id']} from-cli: RUNNING" in capsys.readouterr().out


def test_a_reader_that_goes_away_ends_the_command_quietly(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fusetune status | head`: once the reader has closed the pipe, the command stops
    without a traceback (exit 1), as other Unix tools do."""
    import subprocess

    token = create(server, capsys, "acme")["token"]["token"]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"workload": "digits-cnn", "n_trials": 3, "name": "piped"}))
    assert main(["submit", str(sweep), "--url", server.url, "--token", token]) == 0
    read, write = os.pipe()
    os.close(read)  # gone before the command writes anything: its first write fails
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fusetune.server.cli", "status", "--url", server.url, "--token", token],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
        )
    finally:
        os.close(write)
    assert done.returncode == 1 and done.stderr == "", done.stderr


def test_the_token_comes_from_the_environment(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    token = create(server, capsys, "acme")["token"]["token"]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"workload": "digits-cnn", "n_trials": 3, "name": "env"}))
    monkeypatch.delenv("FUSETUNE_TOKEN", raising=False)
    assert main(["submit", str(sweep), "--url", server.url]) == 2
    assert "401" in capsys.readouterr().err
    monkeypatch.setenv("FUSETUNE_TOKEN", token)
    assert main(["submit", str(sweep), "--url", server.url]) == 0
    assert json.loads(capsys.readouterr().out)["tenant"] == "acme"
    assert main(["status", "--url", server.url]) == 0
    assert "env" in capsys.readouterr().out
    # And the service's URL, as the Python client reads it.
    monkeypatch.setenv("FUSETUNE_URL", server.url)
    assert main(["status"]) == 0
    assert "env" in capsys.readouterr().out


def test_rejected_submission_says_why(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "bad.json"
    sweep.write_text(json.dumps({"workload": "digits-cnn", "n_trials": 0}))
    assert main(["submit", str(sweep), "--url", server.url, f"--token={server.admin_token}"]) == 2
    assert "n_trials" in capsys.readouterr().err


OWN_WORKLOAD = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fusetune import Workload


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True), "hidden": trial.suggest_categorical("hidden", [8, 16])}


def data():
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    return TensorDataset(x[:12], y[:12]), TensorDataset(x[12:], y[12:])


def build(params):
    return nn.Sequential(nn.Linear(4, params["hidden"]), nn.ReLU(), nn.Linear(params["hidden"], 3))


WORKLOAD = Workload(
    name="cli-own", build_model=build, search_space=space, datasets=data,
    loss=nn.functional.cross_entropy, metric=lambda output, target: float((output.argmax(-1) == target).float().mean()),
)
"""


@pytest.fixture
def own_code(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder of the user's own code, ``<module>.py`` defining ``WORKLOAD`` (and a ``data/``
    folder to leave out); the module is forgotten afterwards."""
    module = f"cli_own_{uuid.uuid4().hex[:10]}"
    code = tmp_path / "code"
    (code / "data").mkdir(parents=True)
    (code / f"{module}.py").write_text(OWN_WORKLOAD)
    (code / "data" / "big.bin").write_bytes(os.urandom(4096))
    yield code, module
    for name in [n for n in sys.modules if n == module]:
        del sys.modules[name]


def test_submit_with_code_packages_uploads_once_and_needs_code_upload(
    server: Server, tmp_path: Path, own_code: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``fusetune submit --code DIR``: the body's workload is a module:attr path in DIR. The
    study records the package the CLI made (the bytes the service then serves are those bytes),
    and a tenant without the admin's code_upload is refused, naming it. Nothing here trains: the
    server runs no scheduling loop."""
    code, module = own_code
    token = create(server, capsys, "acme")["token"]["token"]
    mine = ["--url", server.url, "--token", token]
    admin = ["--url", server.url, f"--token={server.admin_token}"]
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"workload": f"{module}:WORKLOAD", "n_trials": 2, "epochs": 1, "name": "own-code"}))
    submit = ["submit", str(sweep), "--code", str(code), "--requirement", "numpy", "--exclude", "data/", *mine]

    assert main(submit) == 2
    refused = capsys.readouterr()
    assert "code_upload" in refused.err and "403" in refused.err and refused.out == ""
    with Client(server.url, token=token) as client:
        assert client.studies() == []

    assert main(["tenants", "set-code-upload", "acme", "on", *mine]) == 2  # the admin's to grant
    assert "403" in capsys.readouterr().err
    assert main(["tenants", "set-code-upload", "acme", "on", *admin]) == 0
    assert json.loads(capsys.readouterr().out)["code_upload"] is True
    assert main(submit) == 0
    out = capsys.readouterr()
    study = json.loads(out.out)
    expected = package(f"{module}:WORKLOAD", code=code, requirements=["numpy"], excludes=["data/"])
    assert f"package {expected.digest}" in out.err and "uploaded" in out.err and "before" not in out.err
    assert study["package"] == expected.digest and study["package_url"] == f"/api/v1/packages/{expected.digest}"
    assert study["workload"] == "cli-own" and study["tenant"] == "acme" and study["name"] == "own-code"
    assert set(study["search_space"]) == {"lr", "hidden"}  # the manifest's, the body naming none
    with Client(server.url, token=token) as client:
        data = client.download_package(expected.digest)
    assert data == expected.data
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert sorted(archive.namelist()) == sorted(["fusetune.json", f"{module}.py"])
        manifest = json.loads(archive.read("fusetune.json"))
    assert manifest["entry"] == f"{module}:WORKLOAD" and manifest["requirements"] == ["numpy"]

    # A second study of the same code uploads nothing; a body's search_space is the package's.
    sweep.write_text(json.dumps({"workload": f"{module}:WORKLOAD", "n_trials": 2, "name": "own-code-again"}))
    assert main(submit) == 0
    again = capsys.readouterr()
    assert json.loads(again.out)["package"] == expected.digest and "uploaded before" in again.err
    space = {"hidden": {"name": "CategoricalDistribution", "attributes": {"choices": [8]}}}
    sweep.write_text(json.dumps({"workload": f"{module}:WORKLOAD", "n_trials": 1, "name": "narrow", "search_space": space}))
    assert main(submit) == 0
    narrow = json.loads(capsys.readouterr().out)
    assert narrow["package"] != expected.digest and set(narrow["search_space"]) == {"hidden"}
    with Client(server.url, token=token) as client:
        narrowed = json.loads(zipfile.ZipFile(io.BytesIO(client.download_package(narrow["package"]))).read("fusetune.json"))
    assert narrowed["search_space"] == space

    # Withdrawn, the grant refuses studies of a package uploaded before, naming it again.
    assert main(["tenants", "set-code-upload", "acme", "off", *admin]) == 0
    capsys.readouterr()
    sweep.write_text(json.dumps({"workload": f"{module}:WORKLOAD", "n_trials": 2, "name": "own-code-withdrawn"}))
    assert main(submit) == 2
    assert "code_upload" in capsys.readouterr().err
    # What cannot be packaged is refused before any upload, naming why.
    assert main(["submit", str(sweep), "--code", str(code / "absent"), *mine]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert main(["submit", str(sweep), "--exclude", "data/", *mine]) == 2
    assert "--code" in capsys.readouterr().err


def test_tenants_over_the_api(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    rest = ["--url", server.url, f"--token={server.admin_token}"]
    created = create(server, capsys, "acme", "--weight", "2", "--max-trials-per-study", "50", "--label", "ci")
    assert created["tenant"] == {
        "name": "acme", "weight": 2.0, "max_running_studies": None, "max_trials_per_study": 50, "code_upload": False,
    }
    assert created["token"]["label"] == "ci" and created["token"]["token"].startswith("ft_")
    token = created["token"]["token"]

    assert main(["tenants", "list", *rest]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["acme", "2", "-", "50", "off"] and lines[2].split() == ["default", "1", "-", "-", "off"]

    assert main(["tenants", "set-weight", "acme", "4.5", *rest]) == 0
    assert json.loads(capsys.readouterr().out)["weight"] == 4.5
    assert main(["tenants", "set-quota", "acme", "--max-running-studies", "3", "--max-trials-per-study", "none", *rest]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "name": "acme", "weight": 4.5, "max_running_studies": 3, "max_trials_per_study": None, "code_upload": False,
    }
    # One quota named: the other stays as it is.
    assert main(["tenants", "set-quota", "acme", "--max-trials-per-study", "500", *rest]) == 0
    assert json.loads(capsys.readouterr().out)["max_running_studies"] == 3
    assert main(["tenants", "set-quota", "acme", "--max-running-studies", "none", *rest]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "name": "acme", "weight": 4.5, "max_running_studies": None, "max_trials_per_study": 500, "code_upload": False,
    }
    with pytest.raises(SystemExit) as exit_:
        main(["tenants", "set-quota", "acme", "--max-running-studies", "many", *rest])
    assert exit_.value.code == 2 and "a count or 'none', not 'many'" in capsys.readouterr().err
    assert main(["tenants", "set-code-upload", "acme", "on", *rest]) == 0
    capsys.readouterr()
    assert main(["tenants", "list", *rest]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[-1] == "on"

    # A tenant's own token: no weights, but its own tokens.
    mine = ["--url", server.url, "--token", token]
    assert main(["tenants", "set-weight", "acme", "100", *mine]) == 2
    assert "403" in capsys.readouterr().err
    assert main(["tenants", "create", "evil", *mine]) == 2
    assert "403" in capsys.readouterr().err
    assert main(["tenants", "token", "acme", "--label", "laptop", *mine]) == 0
    laptop = json.loads(capsys.readouterr().out)
    assert main(["tenants", "tokens", "acme", *mine]) == 0
    listed = capsys.readouterr().out
    assert "ci" in listed and "laptop" in listed and token not in listed and laptop["token"] not in listed
    assert main(["tenants", "revoke", str(laptop["id"]), *mine]) == 0
    assert f"token {laptop['id']} of tenant acme revoked" in capsys.readouterr().out
    assert main(["status", "--url", server.url, "--token", laptop["token"]]) == 2
    assert "401" in capsys.readouterr().err
    assert main(["status", *mine]) == 0


def test_a_tenants_text_reaches_the_admins_terminal_as_text(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    """A token label (any tenant's text) with a terminal's escape sequences: an OSC 52 clipboard
    write, a screen clear and a right-to-left override, printed as visible escapes."""
    rest = ["--url", server.url, f"--token={server.admin_token}"]
    create(server, capsys, "mallory")
    label = "laptop\x1b]52;c;ZWNobyBwd25lZA==\x07\x1b[2J\u202etxt.exe"
    assert main(["tenants", "token", "mallory", "--label", label, *rest]) == 0
    assert "\x1b" not in capsys.readouterr().out  # the JSON escapes it already
    assert main(["tenants", "tokens", "mallory", *rest]) == 0
    listed = capsys.readouterr().out
    assert "\x1b" not in listed and "\x07" not in listed and "\u202e" not in listed
    assert "laptop\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\x1b[2J\\u202etxt.exe" in listed


def test_tenants_bootstrap_on_the_database_without_an_admin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No FUSETUNE_ADMIN_TOKEN: the operator creates tenants on the database, and the server takes their tokens."""
    url = f"sqlite:///{tmp_path / 'ops.db'}"
    assert main(["tenants", "create", "acme", "--weight", "3", "--database-url", url]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["tenant"]["weight"] == 3.0
    assert main(["tenants", "create", "acme", "--database-url", url]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["tenants", "set-weight", "acme", "0", "--database-url", url]) == 2
    assert "weight" in capsys.readouterr().err
    assert main(["tenants", "set-code-upload", "acme", "on", "--database-url", url]) == 0
    assert json.loads(capsys.readouterr().out)["code_upload"] is True
    for server in serve(url, admin_token=None):
        assert main(["status", "--url", server.url, "--token", created["token"]["token"]]) == 0
        assert main(["tenants", "list", "--url", server.url, "--token", created["token"]["token"]]) == 0
        assert capsys.readouterr().out.splitlines()[1].split() == ["acme", "3", "-", "-", "on"]
        assert main(["tenants", "revoke", str(created["token"]["id"]), "--database-url", url]) == 0
        capsys.readouterr()
        assert main(["status", "--url", server.url, "--token", created["token"]["token"]]) == 2
        assert "401" in capsys.readouterr().err


def test_simulate_is_the_scheduler_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--help"])
    assert exit_info.value.code == 0
    assert "--cluster" in capsys.readouterr().out


def test_a_users_slips_are_one_line_each_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A missing or malformed sweep file, no service at the URL, a URL without its scheme and a
    database that cannot be opened: exit 2 and one line saying which."""
    slips = [
        (["submit", str(tmp_path / "missing.json")], "No such file or directory"),
        (["submit", str(tmp_path / "bad.json")], "bad.json is not JSON"),
        (["submit", str(tmp_path / "code.zip")], "code.zip is not JSON"),  # not even text
        (["status", "--url", f"http://127.0.0.1:{free_port()}"], "cannot reach the service"),  # nothing listens there
        (["status", "--url", "127.0.0.1:8000"], "protocol"),
        (["tenants", "create", "acme", "--database-url", f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}"], "cannot use the database"),
    ]
    (tmp_path / "bad.json").write_text("{workload: digits-mlp}")
    (tmp_path / "code.zip").write_bytes(b"PK\x03\x04\xff\xfe\x00")
    monkeypatch.setenv("FUSETUNE_TOKEN", "ft_whatever")
    for argv, says in slips:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)


@pytest.mark.parametrize(
    ("source", "says"),
    [("def f(:\n    pass\n", "SyntaxError"), ("import math\n\nraise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here")],
)
def test_a_module_that_raises_when_packaged_shows_its_own_frames(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, says: str
) -> None:
    """``submit --code``: the user's module is imported to be packaged (before anything is sent),
    and what it raises is shown with its file and line, not as the CLI's own traceback."""
    code = tmp_path / "code"
    code.mkdir()
    module = f"broken_{uuid.uuid4().hex[:8]}"
    (code / f"{module}.py").write_text(source)
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"workload": f"{module}:WORKLOAD", "n_trials": 2, "epochs": 1}))
    argv = ["submit", str(sweep), "--code", str(code), "--url", f"http://127.0.0.1:{free_port()}", "--token", "ft_whatever"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cannot package the workload: importing its module raised") and says in err, err
    assert f"{module}.py" in err and "cli.py" not in err and "_package.py" not in err, err
