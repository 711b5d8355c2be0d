"""The artifact store on a local directory and on a filesystem that is not local (pyarrow's
in-memory ``mock://``, written through a temporary file and a move, as HDFS is), and the
checkpoint folders a worker keeps in it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fusetune.workers.checkpoints import CheckpointWriter, checkpoint_dir, load_checkpoint, saved_epochs
from fusetune.workers.store import ArtifactStore


@pytest.fixture(params=["local", "mock"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    return ArtifactStore(tmp_path / "store" if request.param == "local" else "mock:///store")


def test_objects_are_written_whole_read_listed_and_removed(store: ArtifactStore) -> None:
    assert store.read("a/b.pt") is None and store.list("a") == []
    store.write("a/b.pt", b"one")
    store.write("a/b.pt", b"two")  # replaced whole
    store.write("a/c.pt", b"three")
    assert store.read("a/b.pt") == b"two" and sorted(store.list("a")) == ["b.pt", "c.pt"]  # no temporary files left
    location = store.save_torch("a/t.pt", {"w": torch.ones(2)})
    assert torch.equal(store.load_torch("a/t.pt")["w"], torch.ones(2))
    assert location.endswith("store/a/t.pt")
    store.delete("a/c.pt")
    store.delete("a/missing.pt")
    assert sorted(store.list("a")) == ["b.pt", "t.pt"]
    store.delete_dir("a")
    assert store.list("a") == [] and not store.exists("a/b.pt")


def test_a_local_store_shows_paths_and_a_uri_store_shows_uris(tmp_path: Path) -> None:
    assert ArtifactStore(tmp_path).location("s/trial-1.pt") == str(tmp_path / "s" / "trial-1.pt")
    assert ArtifactStore(f"file://{tmp_path}").location("s/trial-1.pt") == f"file://{tmp_path}/s/trial-1.pt"


def test_checkpoints_stay_until_the_control_plane_has_recorded_a_newer_one(store: ArtifactStore) -> None:
    writer = CheckpointWriter(store)
    folder = checkpoint_dir("study", 3)
    state = {"w": torch.zeros(1)}
    for epoch in (1, 2, 3):
        writer.save(folder, epoch, state, {"state": {}})
    writer.flush()
    assert saved_epochs(store, folder) == [1, 2, 3] and writer.durable(folder) == 3
    writer.confirm(folder, 2)  # a report naming epoch 2 was recorded: 1 can go, 3 is newer
    writer.flush()
    assert saved_epochs(store, folder) == [2, 3]
    assert load_checkpoint(store, f"{folder}/2.pt")["epochs_done"] == 2
    writer.remove(folder)
    writer.close()
    assert saved_epochs(store, folder) == [] and writer.durable(folder) is None
