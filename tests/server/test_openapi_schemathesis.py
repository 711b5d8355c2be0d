"""Schemathesis against the live API: the OpenAPI document says exactly what the API does.

Every check (server errors, status codes, content types, headers, response schemas, schema-
valid bodies accepted and schema-violating ones rejected, missing headers, unsupported
methods and their Allow, use after free, resource availability, ignored auth, ...) over
every phase (the schema's examples, coverage, fuzzing, and the stateful phase that follows
the document's links), with three seeds and the admin's token, against uvicorn serving the
API alone over real HTTP, on SQLite and on PostgreSQL (two seeds on one, one on the other). The database is seeded first with
what the scheduling loop would have written (a study with trials of every state, an array on
a worker, an idle worker, events of every kind), so the answers that carry them, event
streams included, are checked against their schemas too. ``tests/server/schemathesis.toml``
says which answers are expected beyond the defaults, and why. Each run is bounded by
``--max-examples``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusetune.server import events
from fusetune.server.db import Array, ArrayMember, ArrayState, TrialState, Worker, get_sessionmaker
from tests.server.conftest import LiveApi, live_api
from tests.server.test_reads import mixed_trials, seed

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).with_name("schemathesis.toml")
#: Three seeds, each a different walk through every phase, spread over the two databases: the
#: database changes what the API answers far less than the seed changes what is asked.
RUNS = [("sqlite", 0), ("postgresql", 1), ("sqlite", 2)]
#: Examples per operation and phase. A run takes 40-50 s on the 2-core machine (the coverage
#: phase, ~20 s, does not depend on it), so the three runs take about 2.5 minutes, where one
#: seed at 25 examples took 3.3 (its event streams then lasted a second each).
MAX_EXAMPLES = 20


@pytest.fixture
def served(database_url: str, tmp_path: Path) -> Iterator[LiveApi]:
    """The API alone, on SQLite and on PostgreSQL, seeded; its event streams end after a
    tenth of a second (they would follow forever)."""
    lives = live_api(database_url, events_max_stream_s=0.1, max_body_bytes=64 * 1024, artifact_dir=tmp_path / "artifacts")
    live = next(lives)
    try:
        seed_every_kind_of_row(live)
        yield live
    finally:
        lives.close()  # stops the server


def seed_every_kind_of_row(live: LiveApi) -> None:
    """What a scheduling loop leaves: a tenant's study with trials of every state, a running
    array on a busy worker beside an idle one, and an event of every kind."""
    _, token = live.create_tenant("seeded")
    study = live.client(token).post("/api/v1/studies", json={"workload": "digits-mlp", "n_trials": 20, "epochs": 3})
    assert study.status_code == 201, study.text
    study_id = study.json()["id"]
    trial_ids = seed(live.database_url, study_id, mixed_trials(8, seed_=29) + [(TrialState.RUNNING, None, {0: 0.4})])
    with get_sessionmaker(live.database_url)() as session:
        busy, idle = Worker(name="cpu-0", device_type="cpu", node="node-0"), Worker(name="cpu-1", device_type="cpu", node="node-0")
        session.add_all([busy, idle])
        session.flush()
        array = Array(
            study_id=study_id, signature="s" * 64, state=ArrayState.RUNNING, worker_id=busy.id, epochs_done=1,
            members=[ArrayMember(slot=0, trial_id=trial_ids[-1])],
        )
        session.add(array)
        session.flush()
        for kind in events.KINDS:
            events.record(
                session, kind, tenant="seeded", study_id=study_id, trial_id=trial_ids[-1], array_id=array.id,
                step=0, value=0.4, state="RUNNING",
            )
        session.commit()


@pytest.mark.parametrize(("database_url", "seed_"), RUNS, indirect=["database_url"])
def test_schemathesis_finds_nothing(served: LiveApi, tmp_path: Path, seed_: int) -> None:
    command = [
        sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
        "--config-file", str(CONFIG),
        "run", f"{served.url}/openapi.json",
        "--checks", "all",
        "--phases", "examples,coverage,fuzzing,stateful",
        "--seed", str(seed_),
        "--max-examples", str(MAX_EXAMPLES),
        "--workers", "1",
        "--request-timeout", "30",
        "--header", f"Authorization: Bearer {served.admin_token}",
        "--report-dir", str(tmp_path / "report"),
        "--no-color",
    ]
    hooks = {"SCHEMATHESIS_HOOKS": str(Path(__file__).with_name("schemathesis_hooks.py"))}
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path, env={**os.environ, **hooks})
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-20000:]
    assert "Stateful" in output and "Coverage" in output, output[-4000:]
