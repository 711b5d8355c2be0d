"""The `fusetune` command against a live API server."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusetune.server.cli import BackgroundServer, main
from fusetune.server.settings import Settings
from tests.conftest import free_port


@dataclass
class Server:
    url: str
    database_url: str
    admin_token: str | None


def serve(database_url: str, admin_token: str | None) -> Iterator[Server]:
    settings = Settings(database_url=database_url, port=free_port(), admin_token=admin_token)
    server = BackgroundServer(settings, schedule=False).start()
    try:
        yield Server(server.url, database_url, admin_token)
    finally:
        server.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from serve(f"sqlite:///{tmp_path / 'cli.db'}", secrets.token_urlsafe(32))


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


def test_rejected_submission_says_why(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "bad.json"
    sweep.write_text(json.dumps({"workload": "digits-cnn", "n_trials": 0}))
    assert main(["submit", str(sweep), "--url", server.url, f"--token={server.admin_token}"]) == 2
    assert "n_trials" in capsys.readouterr().err


def test_tenants_over_the_api(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    rest = ["--url", server.url, f"--token={server.admin_token}"]
    created = create(server, capsys, "acme", "--weight", "2", "--max-trials-per-study", "50", "--label", "ci")
    assert created["tenant"] == {"name": "acme", "weight": 2.0, "max_running_studies": None, "max_trials_per_study": 50}
    assert created["token"]["label"] == "ci" and created["token"]["token"].startswith("ft_")
    token = created["token"]["token"]

    assert main(["tenants", "list", *rest]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["acme", "2", "-", "50"] and lines[2].split() == ["default", "1", "-", "-"]

    assert main(["tenants", "set-weight", "acme", "4.5", *rest]) == 0
    assert json.loads(capsys.readouterr().out)["weight"] == 4.5
    assert main(["tenants", "set-quota", "acme", "--max-running-studies", "3", "--max-trials-per-study", "none", *rest]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "name": "acme", "weight": 4.5, "max_running_studies": 3, "max_trials_per_study": None
    }

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
    for server in serve(url, admin_token=None):
        assert main(["status", "--url", server.url, "--token", created["token"]["token"]]) == 0
        assert main(["tenants", "list", "--url", server.url, "--token", created["token"]["token"]]) == 0
        assert capsys.readouterr().out.splitlines()[1].split() == ["acme", "3", "-", "-"]
        assert main(["tenants", "revoke", str(created["token"]["id"]), "--database-url", url]) == 0
        capsys.readouterr()
        assert main(["status", "--url", server.url, "--token", created["token"]["token"]]) == 2
        assert "401" in capsys.readouterr().err


def test_simulate_is_the_scheduler_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--help"])
    assert exit_info.value.code == 0
    assert "--cluster" in capsys.readouterr().out
