"""Events of a real sweep (live uvicorn, the scheduling loop, Ray workers) in order, resumed
with Last-Event-ID exactly after the last one seen; /metrics against the same database."""

from __future__ import annotations

from pathlib import Path

import httpx
import optuna
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from fusetune.server.db import Array, Trial, TrialState, get_sessionmaker
from tests.conftest import running_service
from tests.sse import events_of, follow_until_done

pytestmark = pytest.mark.slow
ONE_SHAPE = {"hidden": optuna.distributions.distribution_to_json(optuna.distributions.CategoricalDistribution([32]))}
EPOCHS = 2


def test_a_sweeps_events_arrive_in_order_and_resume_after_the_last_seen(ray_cluster: str, database_url: str, tmp_path: Path) -> None:
    with running_service(
        ray_cluster, database_url, cpu_workers=1, max_array_size=4, artifact_dir=tmp_path, events_max_stream_s=5.0
    ) as client:
        study = client.create_study("digits-mlp", n_trials=4, epochs=EPOCHS, name="evented", search_space=ONE_SHAPE)
        http = httpx.Client(base_url=client.url, headers={"Authorization": f"Bearer {client.token}"}, timeout=120)
        seen = follow_until_done(http, study["id"])

        ids = [int(e["id"]) for e in seen]
        assert ids == sorted(set(ids)), "ids increase, no event twice"
        assert all(e["data"]["study_id"] == study["id"] and e["data"]["tenant"] == "default" for e in seen)
        trials = {t["id"]: t for t in client.trials(study["id"])}
        assert len(trials) == 4 and {t["state"] for t in trials.values()} == {"COMPLETE"}
        # Each trial: asked, started, one report per epoch in step order, ended with its value.
        for trial_id, trial in trials.items():
            mine = [e for e in seen if e["data"]["trial_id"] == trial_id]
            kinds = [e["event"] for e in mine]
            assert kinds == ["trial.asked", "trial.started", *["trial.reported"] * EPOCHS, "trial.ended"], kinds
            assert [e["data"]["data"]["step"] for e in mine if e["event"] == "trial.reported"] == list(range(EPOCHS))
            ended = mine[-1]["data"]
            assert ended["data"]["state"] == "COMPLETE" and ended["data"]["value"] == pytest.approx(trial["value"])
            reports = [e["data"]["data"]["value"] for e in mine if e["event"] == "trial.reported"]
            assert reports == pytest.approx([trial["intermediate_values"][str(s)] for s in range(EPOCHS)])
        # Arrays: started before their members' reports, ended after them.
        arrays = client.arrays(study["id"])
        for array in arrays:
            position = {e["event"]: i for i, e in enumerate(seen) if e["data"]["array_id"] == array["id"] and e["event"].startswith("array.")}
            reports = [i for i, e in enumerate(seen) if e["event"] == "trial.reported" and e["data"]["array_id"] == array["id"]]
            assert position["array.started"] < min(reports) and position["array.ended"] > max(reports)
            started = next(e for e in seen if e["event"] == "array.started" and e["data"]["array_id"] == array["id"])
            assert started["data"]["data"]["trial_ids"] == array["trial_ids"]
        completed = [i for i, e in enumerate(seen) if e["event"] == "study.completed"]
        ended = [i for i, e in enumerate(seen) if e["event"] == "trial.ended"]
        assert len(completed) == 1 and completed[0] > max(ended)

        # Reconnecting with Last-Event-ID gets exactly what came after, nothing before, nothing twice.
        for cut in (0, len(seen) // 2, len(seen) - 2):
            rest = http.get(f"/api/v1/studies/{study['id']}/events", params={"follow": "false"},
                            headers={"Last-Event-ID": seen[cut]["id"]})
            assert events_of(rest.text) == seen[cut + 1 :]

        # /metrics says what the database says.
        scraped = http.get("/metrics")
        assert scraped.status_code == 200
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(scraped.text)
            for s in family.samples
        }
        with get_sessionmaker(database_url)() as session:
            counts = dict(session.execute(select(Trial.state, func.count()).group_by(Trial.state)).all())
            epochs_done = session.scalar(select(func.sum(Array.epochs_done)))
        for state in TrialState:
            assert samples[("fusetune_trials", (("state", state.value),))] == counts.get(state, 0)
        assert samples[("fusetune_epoch_reports_total", ())] == epochs_done >= EPOCHS
        assert samples[("fusetune_arrays_running", ())] == 0
        assert samples[("fusetune_workers", (("state", "busy"),))] + samples[("fusetune_workers", (("state", "idle"),))] == 1
        http.close()
