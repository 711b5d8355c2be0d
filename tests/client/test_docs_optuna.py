"""docs/optuna.md: every example on the page runs, as a program of its own, against a live service."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusetune.client import Client
from tests.conftest import running_service

pytestmark = pytest.mark.slow

PAGE = Path(__file__).resolve().parents[2] / "docs" / "optuna.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_the_three_ways_in() -> None:
    assert len(EXAMPLES) == 3


@pytest.fixture(scope="module")
def service(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    url = f"sqlite:///{tmp_path_factory.mktemp('docs') / 'fusetune.db'}"
    with running_service(ray_cluster, url, max_array_size=4) as client:
        yield client


@pytest.mark.parametrize("index", range(len(EXAMPLES)), ids=["sampler-plugin", "create-study", "optimize"])
def test_the_example_runs(index: int, service: Client, tmp_path: Path) -> None:
    env = {**os.environ, "FUSETUNE_URL": service.url, "FUSETUNE_TOKEN": service.token or ""}
    done = subprocess.run(
        [sys.executable, "-c", EXAMPLES[index]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
