"""Models as people write them, swept through a live service (real Ray, real uvicorn).

* A Transformer classifier with a learned positional ``nn.Parameter`` trains fused (fusion's
  batched path): every trial COMPLETE, arrays of more than one member, no warning.
* A model with a block vmap cannot run trains fused, that block once per member: the study
  says so in its warnings.
* A model that fuses by neither path trains unfused, one member per array: its first array
  gives its members back untrained, the study's warning names the module and why, every
  trial COMPLETE; a restarted service remembers it (no fused array of it is tried again).

The workloads (``tests/people_workloads.py``) are imported by path: a workload registered in
this process would not be in the Ray workers'.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fusetune.client import Client
from fusetune.server.db import get_optuna_storage
from tests.conftest import _postgres_database, members_at_once, running_service
from tests.faults import wait_until

pytestmark = pytest.mark.slow

RANDOM = {"name": "RandomSampler", "kwargs": {"seed": 0}}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'fusetune.db'}"
    else:
        yield from _postgres_database()


def settings(root: Path, workers: int) -> dict[str, object]:
    return {
        "cpu_workers": workers, "max_array_size": 4, "artifact_dir": root / "artifacts", "allow_workload_imports": True,
    }


def ended_arrays(client: Client, study_id: int) -> list[dict]:
    """The study's arrays once every one has recorded its outcome (which may come just after
    the study's last epoch)."""
    return wait_until(
        lambda: (arrays := client.arrays(study_id)) and all(a["state"] != "RUNNING" for a in arrays) and arrays,
        f"study {study_id}'s arrays to end",
    )


def test_fused_models_as_people_write_them(ray_cluster: str, database_url: str, tmp_path: Path) -> None:
    """Both sweeps train fused, in arrays of more than one member; the one whose block runs
    once per member says so, once, naming the block."""
    with running_service(ray_cluster, database_url, **settings(tmp_path, workers=2)) as client:
        positional = client.create_study("tests.people_workloads:POSITIONAL", n_trials=6, epochs=2, sampler=RANDOM)
        gated = client.create_study("tests.people_workloads:PER_MEMBER", n_trials=4, epochs=2, sampler=RANDOM)
        for study in (positional, gated):
            done = client.wait(study["id"], timeout=600)
            assert done["state"] == "COMPLETE" and done["trial_counts"]["COMPLETE"] == study["n_trials"], done
            assert {t["state"] for t in client.trials(study["id"])} == {"COMPLETE"}
            assert {a["state"] for a in ended_arrays(client, study["id"])} == {"COMPLETE"}
            assert max(members_at_once(database_url, study["id"]).values()) > 1
        assert client.study(positional["id"])["warnings"] == []
        (warning,) = client.study(gated["id"])["warnings"]
        assert warning.startswith("submodule 'block' (Gate) runs once per member") and ".item()" in warning


def test_a_model_that_fuses_by_neither_path_trains_unfused(ray_cluster: str, database_url: str, tmp_path: Path) -> None:
    """Its first array (of three) gives its members back untrained; they train one per array;
    the study's warning names the module. A restarted service trains the study's next trials
    one per array from the start: what was found is stored with the study."""
    with running_service(ray_cluster, database_url, **settings(tmp_path, workers=1)) as client:
        study = client.create_study("tests.people_workloads:UNFUSIBLE", n_trials=3, epochs=2, sampler=RANDOM)
        done = client.wait(study["id"], timeout=600)
        assert done["state"] == "COMPLETE" and done["trial_counts"]["COMPLETE"] == 3, done
        assert {t["state"] for t in client.trials(study["id"])} == {"COMPLETE"}
        (warning,) = done["warnings"]
        assert "fuses by neither path" in warning and "submodule 'out' (Temperature)" in warning
        assert "modified inplace" in warning and ".item()" in warning  # the per-member loop's reason, and vmap's
        arrays = ended_arrays(client, study["id"])
        tried = [a for a in arrays if a["state"] == "FAIL"]
        assert len(tried) == 1 and tried[0]["size"] == 3 and "fuses by neither path" in tried[0]["error"]
        widest = members_at_once(database_url, study["id"])
        trained = [a for a in arrays if a["state"] == "COMPLETE"]
        assert trained and all(widest[a["id"]] == 1 for a in trained)
        first_arrays = {a["id"] for a in arrays}

    storage = get_optuna_storage(database_url)
    stored = storage.get_study_system_attrs(storage.get_study_id_from_name(study["name"]))
    assert list(stored["fusetune:unfusible"].values()) == [warning.split(": ", 1)[1]]
    with running_service(ray_cluster, database_url, **settings(tmp_path, workers=1)) as client:
        client.update_study(study["id"], n_trials=5)
        done = client.wait(study["id"], timeout=600)
        assert done["trial_counts"]["COMPLETE"] == 5 and done["warnings"] == [warning]
        later = [a for a in ended_arrays(client, study["id"]) if a["id"] not in first_arrays]
        assert later and {a["state"] for a in later} == {"COMPLETE"}
        widest = members_at_once(database_url, study["id"])
        assert all(widest[a["id"]] == 1 for a in later)
