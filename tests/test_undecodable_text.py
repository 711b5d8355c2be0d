"""Text from a tenant's code that UTF-8 cannot encode (a lone surrogate in an exception's
message) is stored with the surrogate as its escape (server/db/text.py): the trials fail with
their errors, and every read of them answers, on SQLite and PostgreSQL. Before, the array's
outcome could not be written (its trials stayed RUNNING) and a model factory's error failed
the study with a UnicodeEncodeError instead of its own message."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import optuna
import pytest

from tests.conftest import running_service
from tests.test_faults import ONE_SHAPE

pytestmark = pytest.mark.slow
ESCAPED_BUILD, ESCAPED_LOSS = "no model of width \\ud800 here", "the loss \\udcff broke"


def test_errors_a_tenants_code_raised_with_a_lone_surrogate_are_stored_and_read_back(
    ray_cluster: str, database_url: str, tmp_path: Path,
) -> None:
    with running_service(ray_cluster, database_url, cpu_workers=1, max_array_size=4, allow_workload_imports=True,
                         artifact_dir=tmp_path / "artifacts") as client:
        unbuildable = client.create_study("tests.surrogate_workload:UNBUILDABLE", n_trials=2, epochs=1, name="text-build")
        untrainable = client.create_study("tests.surrogate_workload:UNTRAINABLE", n_trials=2, epochs=1, name="text-loss",
                                          search_space=ONE_SHAPE)
        fine = client.create_study("digits-mlp", n_trials=2, epochs=1, name="text-fine", search_space=ONE_SHAPE)
        for study, escaped in ((unbuildable, ESCAPED_BUILD), (untrainable, ESCAPED_LOSS)):
            done = client.wait(study["id"], timeout=300)
            assert done["state"] == "FAILED" and done["trial_counts"]["FAIL"] == 2
            assert escaped in done["error"], done["error"]
            assert all(escaped in t["error"] for t in client.trials(study["id"]))
            # The study's event stream replays them (each event's data is stored JSON).
            with httpx.Client(base_url=client.url, headers={"Authorization": f"Bearer {client.token}"}, timeout=60) as http:
                with http.stream("GET", f"/api/v1/studies/{study['id']}/events", params={"after": 0}) as stream:
                    assert stream.status_code == 200
                    ended = []
                    for line in stream.iter_lines():
                        if line.startswith("data: "):
                            event = json.loads(line[len("data: "):])
                            if event["kind"] == "trial.ended":
                                ended.append(event["data"]["error"])
                            if event["kind"] == "study.completed":
                                break
            assert len(ended) == 2 and all(escaped in e for e in ended)
        assert client.wait(fine["id"], timeout=300)["state"] == "COMPLETE"
        # Optuna reads the same database: its view of the failure reads back too.
        summaries = optuna.get_all_study_summaries(database_url)
        assert {s.study_name for s in summaries} >= {"text-build", "text-loss", "text-fine"}
