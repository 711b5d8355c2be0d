"""The `fusetune` command against a live API server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusetune.server.cli import BackgroundServer, main
from fusetune.server.settings import Settings
from tests.conftest import free_port


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'cli.db'}", port=free_port())
    server = BackgroundServer(settings, schedule=False).start()
    try:
        yield server.url
    finally:
        server.stop()


def test_submit_then_status(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"workload": "digits-cnn", "n_trials": 3, "name": "from-cli"}))
    assert main(["submit", str(sweep), "--url", url]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["name"] == "from-cli" and created["n_trials"] == 3

    assert main(["status", "--url", url]) == 0
    assert "from-cli" in capsys.readouterr().out
    assert main(["status", str(created["id"]), "--url", url]) == 0
    assert f"study {created['id']} from-cli: RUNNING" in capsys.readouterr().out


def test_rejected_submission_says_why(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "bad.json"
    sweep.write_text(json.dumps({"workload": "digits-cnn", "n_trials": 0}))
    assert main(["submit", str(sweep), "--url", url]) == 2
    assert "n_trials" in capsys.readouterr().err


def test_simulate_is_the_scheduler_simulator(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--help"])
    assert exit_info.value.code == 0
    assert "--cluster" in capsys.readouterr().out
