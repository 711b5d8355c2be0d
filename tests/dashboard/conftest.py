"""A live service on a local Ray, a second tenant, and Debian's Chromium driven by Playwright."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port

CHROMIUM = Path("/usr/bin/chromium")

#: The sweep the pages watch: two hidden widths (two shapes), fused in arrays of up to four,
#: pruned by the median rule, so the views have arrays, pruned curves and a best-so-far line.
SWEEP: dict[str, Any] = {
    "name": "dashboard-sweep",
    "workload": "digits-mlp",
    "n_trials": 24,
    "epochs": 10,
    "max_array_size": 4,
    "sampler": {"name": "TPESampler", "kwargs": {"seed": 3}},
    "pruner": {"name": "MedianPruner", "kwargs": {"n_startup_trials": 4, "n_warmup_steps": 2}},
}
#: Two objectives: the progress view draws their Pareto front.
PARETO: dict[str, Any] = {
    "name": "dashboard-pareto",
    "workload": "digits-mlp",
    "n_trials": 8,
    "epochs": 3,
    "max_array_size": 4,
    "metrics": ["accuracy", "n_params"],
}


@dataclass
class Service:
    url: str
    token: str  # tenant "default"
    rival_token: str  # tenant "rival"
    client: Any
    rival: Any
    admin_token: str  # sees every tenant's studies
    database_url: str
    studies: dict[str, int] = field(default_factory=dict)

    def study(self, spec: dict[str, Any]) -> int:
        """The id of the study ``spec`` names, submitted now unless a test already did."""
        if spec["name"] not in self.studies:
            self.studies[spec["name"]] = self.client.create_study(**spec)["id"]
        return self.studies[spec["name"]]

    def finished(self, spec: dict[str, Any], timeout: float = 900) -> int:
        study_id = self.study(spec)
        study = self.client.wait(study_id, timeout=timeout, poll=1.0)
        assert study["state"] == "COMPLETE", study
        return study_id


@contextmanager
def served(ray_address: str, database_url: str, **settings: Any) -> Iterator[tuple[str, str]]:
    """A live uvicorn serving the whole service, as tests.conftest.running_service starts it;
    yields its URL and its admin token (the pages are also opened as the admin)."""
    from fusetune.server.cli import BackgroundServer
    from fusetune.server.settings import Settings

    admin_token = secrets.token_urlsafe(32)
    config = Settings(database_url=database_url, port=free_port(), ray_address=ray_address, admin_token=admin_token, **settings)
    server = BackgroundServer(config).start()
    try:
        yield server.url, admin_token
    finally:
        server.stop()


@pytest.fixture(scope="module")
def service(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from fusetune.client import Client
    from fusetune.server.cli import DatabaseTenants

    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make system-deps` installs Debian's chromium")
    root = tmp_path_factory.mktemp("dashboard")
    url = f"sqlite:///{root / 'fusetune.db'}"
    with served(ray_cluster, url, cpu_workers=2, artifact_dir=root / "artifacts") as (server_url, admin_token):
        with Client(server_url, token=admin_token) as admin:
            token = admin.create_token("default", label="tests")["token"]
        rival_token = DatabaseTenants(url).create_tenant("rival")["token"]["token"]
        with Client(server_url, token=token) as client, Client(server_url, token=rival_token) as rival:
            yield Service(
                url=server_url, token=token, rival_token=rival_token, client=client, rival=rival,
                admin_token=admin_token, database_url=url,
            )


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab (its own session storage) at 1280×800 that fails the test on a script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.set_default_timeout(60_000)
    try:
        yield page
    finally:
        context.close()
    assert not errors, errors


@pytest.fixture(scope="module")
def shots_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def copy_shots(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for png in src.glob("*.png"):
        shutil.copy(png, dest / png.name)
