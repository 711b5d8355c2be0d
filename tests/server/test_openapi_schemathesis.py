"""Schemathesis against the live API: the OpenAPI document says exactly what the API does.

Every check (server errors, status codes, content types, headers, response schemas, schema-
valid bodies accepted and schema-violating ones rejected, missing headers, unsupported
methods and their Allow, use after free, resource availability, ignored auth, ...) over
every phase (the schema's examples, coverage, fuzzing, and the stateful phase that follows
the document's links), with a fixed seed and the admin's token, against uvicorn serving the
API alone over real HTTP. ``tests/server/schemathesis.toml`` says which answers are expected
beyond the defaults, and why. The run is bounded by ``--max-examples``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import LiveApi, live_api

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).with_name("schemathesis.toml")
MAX_EXAMPLES = 25


@pytest.fixture
def served(database_url: str) -> Iterator[LiveApi]:
    """The API alone, on SQLite and on PostgreSQL; its event streams end after a second (they
    would follow forever)."""
    yield from live_api(database_url, events_max_stream_s=1.0, max_body_bytes=64 * 1024)


def test_schemathesis_finds_nothing(served: LiveApi, tmp_path: Path) -> None:
    command = [
        sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
        "--config-file", str(CONFIG),
        "run", f"{served.url}/openapi.json",
        "--checks", "all",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--seed", "0",
        "--max-examples", str(MAX_EXAMPLES),
        "--workers", "1",
        "--request-timeout", "30",
        "--header", f"Authorization: Bearer {served.admin_token}",
        "--report-dir", str(tmp_path / "report"),
        "--no-color",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-20000:]
    assert "Stateful" in output and "Coverage" in output, output[-4000:]
