"""Bring your own model: a workload from a test's temporary module, trained by a live service.

The service is ``fusetune serve`` in a process of its own (uvicorn, its scheduling loop, its
own local Ray). The workload lives in a module written to a temporary folder that is neither
installed nor on the service's path; the client packages it (``fusetune.client.package``),
uploads it, and the service's workers run it in the package's Ray ``runtime_env``. Every
process that imports the module or builds its model writes its pid to a marker file: the
service's process never appears there.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import optuna
import pytest
import torch

import fusetune.client as ft
from fusetune.client import Client
from tests.faults import ServiceProcess

pytestmark = pytest.mark.slow

SEED = 11
#: The module: a digits MLP whose import and model factory leave the pid of their process.
MODULE = '''
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fusetune import Metric, Workload

MARKER = {marker!r}


def _note(what):
    # Whether the service's secrets reached this process through its environment.
    secret = "secret" if os.environ.get("FUSETUNE_ADMIN_TOKEN") or os.environ.get("FUSETUNE_DATABASE_URL") else "-"
    with open(MARKER, "a") as f:
        f.write(f"{{os.getpid()}} {{what}} {{secret}}\\n")


_note("import")


def build(params):
    _note("build")
    return nn.Sequential(nn.Linear(64, int(params.get("hidden", 32))), nn.ReLU(), nn.Linear(int(params.get("hidden", 32)), 10))


def space(trial):
    return {{"lr": trial.suggest_float("lr", 0.02, 0.3, log=True), "momentum": trial.suggest_float("momentum", 0.0, 0.9)}}


def data():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    return TensorDataset(x[:1400], y[:1400]), TensorDataset(x[1400:], y[1400:])


def accuracy(out, y):
    return (out.argmax(-1) == y).float().mean().item()


WORKLOAD = Workload(
    name={name!r}, build_model=build, search_space=space, datasets=data, loss=F.cross_entropy, metric=accuracy,
    metrics=(Metric("accuracy", accuracy),), optimizer="SGD", optimizer_defaults={{"lr": 0.1, "momentum": 0.9}},
    batch_size=128,
)
'''


def write_module(folder: Path, marker: Path, name: str = "byo-mlp") -> str:
    """A fresh module (a name of its own: nothing imported it before) in ``folder``; its name."""
    module = f"byo_{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(MODULE.format(marker=str(marker), name=name))
    return module


def imported(folder: Path, module: str) -> ModuleType:
    """The module, imported in this (the client's) process."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(folder))


def pids(marker: Path, what: str) -> set[int]:
    if not marker.exists():
        return set()
    return {int(line.split()[0]) for line in marker.read_text().splitlines() if line.split()[1] == what}


def service_env(root: Path) -> dict[str, str]:
    """A service of its own in ``root``: its database, artifacts and pip's wheelhouse."""
    (root / "wheelhouse").mkdir(exist_ok=True)
    return {
        "FUSETUNE_DATABASE_URL": f"sqlite:///{root / 'fusetune.db'}",
        "FUSETUNE_ARTIFACT_DIR": str(root / "artifacts"),
        "FUSETUNE_MAX_ARRAY_SIZE": "4",
        "FUSETUNE_CPU_WORKERS": "1",
        # The operator's pip configuration, as for a private index: this one a local wheelhouse
        # (a package's requirements name packages, never where to fetch them).
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(root / "wheelhouse"),
        # A describer held on purpose (test_a_slow_describer_holds_only_its_own_study) must
        # outlast the other study's whole sweep on a loaded machine.
        "FUSETUNE_PACKAGE_CALL_TIMEOUT_S": "600",
    }


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    root = tmp_path_factory.mktemp("byo")
    server = ServiceProcess(service_env(root), root / "service.log", secrets.token_urlsafe(24)).start()
    try:
        server.healthy()
        with Client(server.url, token=server.admin_token) as admin:
            admin.set_code_upload("default", True)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def token(service: ServiceProcess) -> str:
    return service.token()


def ended(client: Client, study_id: int) -> dict:
    return client.wait(study_id, timeout=600)


def test_a_workload_object_trains_fused_in_workers_as_plain_torch_does_and_never_in_the_server(
    service: ServiceProcess, token: str, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    module = imported(tmp_path / "code", write_module(tmp_path / "code", marker))
    study = ft.create_study(
        workload=module.WORKLOAD, n_trials=4, epochs=2, sampler=optuna.samplers.RandomSampler(seed=SEED),
        url=service.url, token=token,
    )
    with Client(service.url, token=token) as client:
        (row,) = [s for s in client.studies() if s["name"] == study.study_name]
        done = ended(client, row["id"])
        assert done["state"] == "COMPLETE", done
        assert done["package"] and done["package_url"] == f"/api/v1/packages/{done['package']}"
        trials = client.trials(row["id"])
        (array,) = {t["array_id"] for t in trials}  # one array of the four: fused
        weights = {t["number"]: torch.load(_bytes(client.download_state_dict(t["id"])), weights_only=True) for t in trials}
    assert all(t["state"] == "COMPLETE" for t in trials)
    # The client imported the module (and built nothing); the describer and the worker built its
    # models; the service's own process did neither.
    assert pids(marker, "import") == {__import__("os").getpid()}
    builders = pids(marker, "build")
    # The service's own settings (its database, its admin token) never reach tenant code.
    assert not [line for line in marker.read_text().splitlines() if line.endswith(" secret") and " build " in f" {line} "]
    assert builders and service.proc is not None and service.proc.pid not in builders and __import__("os").getpid() not in builders
    # Each member's weights are plain torch's: its model seeded as the worker seeds it, SGD
    # with its params, the array's one data order.
    seed = done["sampler"]["kwargs"]["seed"]  # the study's training seed: its sampler's, as stored
    for t in trials:
        plain = plain_training(module.WORKLOAD, t["params"], seed=seed + t["number"], order_seed=seed, epochs=2)
        for name, tensor in plain.items():
            torch.testing.assert_close(weights[t["number"]][name], tensor, rtol=1e-4, atol=1e-5)


#: Put after the module's import note: every process but the client's holds there until ``gate`` exists.
GATED = '''_note("import")
while os.getpid() != {client} and not os.path.exists({gate!r}):
    import time

    time.sleep(0.05)
'''


def test_new_codes_idle_worker_starts_in_its_env_while_the_describer_loads_it(
    service: ServiceProcess, token: str, tmp_path: Path
) -> None:
    """The first array of new code does not wait for its worker's restart: while the package's
    describer loads it (held here, at its import, until the test lets it go), the idle worker
    starts in the package's env and imports the code as well. The sweep then trains in that
    very process, which no later restart replaced."""
    marker, gate, folder = tmp_path / "marker", tmp_path / "gate", tmp_path / "code"
    name = write_module(folder, marker, name="byo-warm")
    source = folder / f"{name}.py"
    source.write_text(source.read_text().replace('_note("import")\n', GATED.format(client=os.getpid(), gate=str(gate)), 1))
    study = ft.create_study(  # by its module path: the workers import the module
        workload=f"{name}:WORKLOAD", code=folder, n_trials=2, epochs=1, sampler=optuna.samplers.RandomSampler(seed=SEED),
        url=service.url, token=token,
    )
    # Two service processes import the code while it is held: the describer, and the worker.
    # Nothing was asked meanwhile (the describer has not loaded the package), so no array
    # restarted that worker: it started ahead of the package's first array.
    waited = 0
    while len(pids(marker, "import") - {os.getpid()}) < 2:
        assert waited < 6000, f"only {pids(marker, 'import')} imported the held package"  # 300 s: something is broken
        time.sleep(0.05)
        waited += 1
    held = pids(marker, "import") - {os.getpid()}
    with Client(service.url, token=token) as client:
        (row,) = [s for s in client.studies() if s["name"] == study.study_name]
        assert client.trials(row["id"]) == []  # not asked while the package loads
        gate.touch()
        assert ended(client, row["id"])["state"] == "COMPLETE"
    assert pids(marker, "import") - {os.getpid()} == held  # no process started after the gate opened
    assert pids(marker, "build") <= held


def _bytes(data: bytes) -> object:
    import io

    return io.BytesIO(data)


def plain_training(workload: object, params: dict, seed: int, order_seed: int, epochs: int) -> dict[str, torch.Tensor]:
    """The member trained alone with torch: the model from ``seed``, SGD, the batches in the
    array's order (a permutation per epoch from ``order_seed``)."""
    wl = workload  # a fusetune Workload
    torch.manual_seed(seed)
    model = wl.build_model(params)  # type: ignore[attr-defined]
    opt = torch.optim.SGD(model.parameters(), lr=params["lr"], momentum=params["momentum"])
    (x, y), _ = (d.tensors for d in wl.datasets())  # type: ignore[attr-defined]
    order = torch.Generator().manual_seed(order_seed)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=order)
        for begin in range(0, len(y), wl.batch_size):  # type: ignore[attr-defined]
            idx = perm[begin : begin + wl.batch_size]  # type: ignore[attr-defined]
            opt.zero_grad()
            wl.loss(model(x[idx]), y[idx]).backward()  # type: ignore[attr-defined]
            opt.step()
    return model.state_dict()


def test_optimize_and_the_cli_train_a_module_path_in_a_folder(service: ServiceProcess, token: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    code = tmp_path / "code"
    module = write_module(code, marker, name="byo-path")
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    ft.optimize(study, f"{module}:WORKLOAD", n_trials=3, code=code, epochs=2, url=service.url, token=token)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 3, [(t.state, t.user_attrs, t.system_attrs) for t in study.trials]
    assert all(0.1 < t.value <= 1.0 for t in study.trials), [t.value for t in study.trials]  # above chance
    # The same folder through the CLI: a sweep file naming the module path.
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"workload": f"{module}:WORKLOAD", "n_trials": 2, "epochs": 1, "name": f"cli-{uuid.uuid4().hex[:6]}"}))
    done = subprocess.run(
        [sys.executable, "-m", "fusetune.server.cli", "submit", str(sweep), "--code", str(code), "--url", service.url, "--token", token],
        capture_output=True, text=True, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    created = json.loads(done.stdout)
    with Client(service.url, token=token) as client:
        assert ended(client, created["id"])["state"] == "COMPLETE"
        assert created["package"] == client.study(created["id"])["package"]
    assert service.proc is not None and service.proc.pid not in pids(marker, "import") | pids(marker, "build")


def test_a_packages_requirements_are_installed_by_ray_where_its_code_runs(
    service: ServiceProcess, token: str, tmp_path: Path
) -> None:
    """``requirements`` go to Ray's ``pip`` runtime_env: Ray installs them in an environment of
    the package's own, and the code imports them there. The requirement names a wheel made
    here, of a module this test's environment does not have, which pip finds where the
    service's operator configured it to look (``PIP_FIND_LINKS``)."""
    _wheel(Path(service.env["PIP_FIND_LINKS"]), "ft_req_probe", 'WHERE = __file__\n')
    marker = tmp_path / "marker"
    code = tmp_path / "code"
    module = write_module(code, marker, name="byo-requirements")
    source = code / f"{module}.py"
    source.write_text(source.read_text().replace(
        '    _note("build")\n',
        '    _note("build")\n    import ft_req_probe\n\n    _note("probe:" + ft_req_probe.WHERE)\n',
    ))
    with pytest.raises(ImportError):
        importlib.import_module("ft_req_probe")
    study = ft.create_study(
        workload=f"{module}:WORKLOAD", code=code, n_trials=2, epochs=1, requirements=["ft-req-probe==1.0"],
        sampler=optuna.samplers.RandomSampler(seed=SEED), url=service.url, token=token,
    )
    with Client(service.url, token=token) as client:
        (row,) = [s for s in client.studies() if s["name"] == study.study_name]
        done = ended(client, row["id"])
        assert done["state"] == "COMPLETE", done["error"]
    # Every process that built the model imported the probe from the environment Ray made,
    # not from this test's.
    places = {line.split()[1].split(":", 1)[1] for line in marker.read_text().splitlines() if line.split()[1].startswith("probe:")}
    assert places and all(not p.startswith(sys.prefix) for p in places), places


def _wheel(folder: Path, module: str, source: str) -> Path:
    """A pure-Python wheel of one module, as a build backend would write it."""
    import base64
    import hashlib
    import zipfile

    def record(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}"

    dist = module.replace("_", "-")
    info = f"{module}-1.0.dist-info"
    files = {
        f"{module}.py": source.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    lines = [record(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(lines) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


#: A module whose define-by-run space is conditional (``kind`` a: ``hidden``; b: ``momentum``),
#: and which raises ``KeyboardInterrupt`` from its space when asked for trial ``INTERRUPT[1]`` of
#: the study named ``INTERRUPT[0]`` (set on the imported module: the space runs in the client's
#: process; packaging and FusionSampler run it on studies of their own).
CONDITIONAL = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from fusetune import Workload

INTERRUPT = None

def build(params):
    hidden = int(params.get("hidden", 16))
    return nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 2))

def space(trial):
    study = getattr(trial, "study", None)
    if INTERRUPT is not None and study is not None and (study.study_name, trial.number) == INTERRUPT:
        raise KeyboardInterrupt
    kind = trial.suggest_categorical("kind", ["a", "b"])
    params = {"kind": kind, "lr": trial.suggest_float("lr", 1e-3, 0.3, log=True)}
    if kind == "a":
        params["hidden"] = trial.suggest_categorical("hidden", [8, 16])
    else:
        params["momentum"] = trial.suggest_float("momentum", 0.0, 0.9)
    return params

def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    return TensorDataset(x[:500], y[:500]), TensorDataset(x[500:], y[500:])

def val_loss(out, y):
    return float(F.cross_entropy(out, y))

WORKLOAD = Workload(name="byo-conditional", build_model=build, search_space=space, datasets=data, loss=F.cross_entropy,
                    metric=val_loss, metric_name="val_loss", direction="minimize", optimizer="SGD", batch_size=50)
'''


def _conditional(tmp_path: Path) -> ModuleType:
    module = f"byo_cond_{uuid.uuid4().hex[:8]}"
    (tmp_path / "cond").mkdir()
    (tmp_path / "cond" / f"{module}.py").write_text(CONDITIONAL)
    return imported(tmp_path / "cond", module)


def test_optimize_trains_each_trial_with_exactly_the_params_its_conditional_space_gave(
    service: ServiceProcess, token: str, tmp_path: Path,
) -> None:
    workload = _conditional(tmp_path).WORKLOAD
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(seed=3))
    study.enqueue_trial({"kind": "a", "lr": 1e6, "hidden": 8})  # diverges: its loss is not finite
    study.enqueue_trial({"kind": "b", "lr": 0.05, "momentum": 0.5})
    ft.optimize(study, workload, n_trials=6, epochs=2, max_array_size=4, url=service.url, token=token)
    with Client(service.url, token=token) as client:
        (row,) = [s for s in client.studies() if s["name"].startswith(study.study_name)]
        trained = {t["user_attrs"]["client_trial_number"]: t["params"] for t in client.trials(row["id"])}
    for trial in study.trials:
        assert trained[trial.number] == trial.params  # nothing sampled on the service beside them
    assert {t.params["kind"] for t in study.trials} == {"a", "b"}
    diverged = study.trials[0]
    assert diverged.state == optuna.trial.TrialState.FAIL
    assert all(v != v for v in diverged.intermediate_values.values())  # reported as NaN, as Optuna takes it
    assert [t.state for t in study.trials[1:]] == [optuna.trial.TrialState.COMPLETE] * 5


def test_an_interrupted_optimize_fails_its_trials_and_cancels_the_service_study(
    service: ServiceProcess, token: str, tmp_path: Path,
) -> None:
    module = _conditional(tmp_path)
    study = optuna.create_study(direction="minimize")
    module.INTERRUPT = (study.study_name, 2)  # Ctrl-C while asking the third, two in flight
    with pytest.raises(KeyboardInterrupt):
        ft.optimize(study, module.WORKLOAD, n_trials=8, epochs=50, n_concurrent=4, url=service.url, token=token)
    # As study.optimize leaves it: the trial being asked and those in flight failed.
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL] * 3
    with Client(service.url, token=token) as client:
        (row,) = [s for s in client.studies() if s["name"].startswith(study.study_name)]
        # The service study holds no worker waiting for pruning answers from a client that left.
        assert row["state"] == "CANCELLED"
        assert ended(client, row["id"])["trial_counts"]["RUNNING"] == 0


#: A module whose workload's name is a str of its own, whose unpickling would create the folder
#: MARKER in whatever process decodes it: the describer sends the name back to the loop (its
#: ``__str__`` returns itself, so ``str()`` of it in the describer changes nothing).
REDUCING = '''
import os
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from fusetune import Workload

MARKER = {marker!r}

class Name(str):
    def __reduce__(self):
        return (os.makedirs, (MARKER,))

    def __str__(self):
        return self

def build(params):
    return nn.Linear(4, 2)

def space(trial):
    return {{"lr": trial.suggest_float("lr", 0.01, 0.1)}}

def data():
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    return TensorDataset(x, y), TensorDataset(x, y)

def accuracy(out, y):
    return float((out.argmax(-1) == y).float().mean())

WORKLOAD = Workload(name=Name("byo-reducing"), build_model=build, search_space=space, datasets=data,
                    loss=F.cross_entropy, metric=accuracy, batch_size=16)
'''


def test_what_a_packages_processes_send_back_never_runs_code_in_the_server(
    service: ServiceProcess, token: str, tmp_path: Path,
) -> None:
    """A tenant's code decides what its describer and workers send, bytes and all: the service
    decodes only the classes of its own protocol (workers/untrusted.py)."""
    marker = tmp_path / "decoded-here"
    code = tmp_path / "reducing"
    code.mkdir()
    module = f"byo_reduce_{uuid.uuid4().hex[:8]}"
    (code / f"{module}.py").write_text(REDUCING.format(marker=str(marker)))
    with Client(service.url, token=token) as client:
        created = ft.create_study(workload=f"{module}:WORKLOAD", code=code, n_trials=2, epochs=1, url=service.url, token=token)
        (row,) = [s for s in client.studies() if s["name"] == created.study_name]
        failed = ended(client, row["id"])
    assert failed["state"] == "FAILED"
    assert "does not decode" in failed["error"], failed["error"]
    assert not marker.exists()  # nothing unpickled the name, in the server or anywhere


#: A module that, in every process but the client's, replaces ``{patch}`` (what a describer
#: answers as a trial's unused params, or a worker's report's warnings) with a list sharing one
#: inner list 2**40 times over: a few hundred bytes sent, and JSON written from it would never
#: end (it froze the whole service).
LAUGHING = '''
import os
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from fusetune import Workload

if os.getpid() != {client}:
    import fusetune.workers.describer as describer
    import fusetune.workers.training as training

    def laughs(*args, **kwargs):
        inner = []
        for _ in range(40):
            inner = [inner, inner]
        return ["lr", inner]

    {patch} = laughs

def build(params):
    return nn.Linear(4, 2)

def space(trial):
    return {{"lr": trial.suggest_float("lr", 0.01, 0.1)}}

def data():
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    return TensorDataset(x, y), TensorDataset(x, y)

def accuracy(out, y):
    return float((out.argmax(-1) == y).float().mean())

WORKLOAD = Workload(name="byo-laughing", build_model=build, search_space=space, datasets=data,
                    loss=F.cross_entropy, metric=accuracy, batch_size=16)
'''


@pytest.mark.parametrize(("patch", "error"), [
    ("describer.unused_params", "not a list of descriptions"),  # the describer's answer
    ("training.ArrayRun._new_warnings", "sent a malformed message: EpochReport.warnings.1"),  # a worker's report
], ids=["describer", "worker"])
def test_what_a_packages_processes_answer_is_checked_before_anything_walks_it(
    service: ServiceProcess, token: str, tmp_path: Path, patch: str, error: str,
) -> None:
    code = tmp_path / "laughing"
    code.mkdir()
    module = f"byo_laughing_{uuid.uuid4().hex[:8]}"
    (code / f"{module}.py").write_text(LAUGHING.format(client=os.getpid(), patch=patch))
    with Client(service.url, token=token) as client:
        created = ft.create_study(workload=f"{module}:WORKLOAD", code=code, n_trials=2, epochs=1, url=service.url, token=token)
        (row,) = [s for s in client.studies() if s["name"] == created.study_name]
        failed = ended(client, row["id"])
        assert failed["state"] == "FAILED" and error in failed["error"], failed["error"]
        other = client.submit({"workload": "digits-mlp", "n_trials": 2, "epochs": 1})
        assert ended(client, other["id"])["state"] == "COMPLETE"


def test_broken_code_fails_its_own_study_with_the_traceback_and_no_other(service: ServiceProcess, token: str, tmp_path: Path) -> None:
    good = imported(tmp_path / "good", write_module(tmp_path / "good", tmp_path / "marker", name="byo-good"))
    with Client(service.url, token=token) as client:
        healthy = ft.create_study(workload=good.WORKLOAD, n_trials=2, epochs=1, url=service.url, token=token)
        bad = _study_of_failing_entry(client, tmp_path)
        failed = ended(client, bad["id"])
        assert failed["state"] == "FAILED"
        assert "Traceback" in failed["error"] and "the tenant's module is broken" in failed["error"], failed["error"]
        (row,) = [s for s in client.studies() if s["name"] == healthy.study_name]
        assert ended(client, row["id"])["state"] == "COMPLETE"


def _study_of_failing_entry(client: Client, tmp_path: Path) -> dict:
    """A study whose package's entry module raises when the workers import it: its manifest
    is made by hand (the client would have to import it, and it raises)."""
    from fusetune.client._package import _zip, workload_metadata

    code = tmp_path / "failing"
    marker = tmp_path / "failing-marker"
    module = write_module(code, marker, name="byo-failing")
    workload = imported(code, module).WORKLOAD
    source = (code / f"{module}.py").read_text() + '\nraise RuntimeError("the tenant\'s module is broken on the workers")\n'
    manifest = {
        "format": 1, "entry": f"{module}:WORKLOAD", "pickle": None, "workload": workload_metadata(workload),
        "search_space": {"lr": json.loads(optuna.distributions.distribution_to_json(optuna.distributions.FloatDistribution(0.01, 0.1)))},
        "requirements": [], "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    data = _zip({f"{module}.py": source.encode(), "fusetune.json": json.dumps(manifest).encode()})
    pkg = ft.Package(__import__("hashlib").sha256(data).hexdigest(), data, manifest)
    client.ensure_package(pkg)
    return client.submit({"workload": "byo-failing", "package": pkg.digest, "n_trials": 2, "epochs": 1})


def test_code_upload_is_the_admins_to_grant_and_the_same_code_is_stored_once(service: ServiceProcess, tmp_path: Path) -> None:
    module = imported(tmp_path / "code", write_module(tmp_path / "code", tmp_path / "marker", name="byo-once"))
    tenant = f"t{uuid.uuid4().hex[:6]}"
    with Client(service.url, token=service.admin_token) as admin:
        admin.create_tenant(tenant)
        other = admin.create_token(tenant, label="byo")["token"]
    with pytest.raises(PermissionError, match="code_upload"):
        ft.create_study(workload=module.WORKLOAD, n_trials=1, epochs=1, url=service.url, token=other)
    pkg = ft.package(module.WORKLOAD)
    stored = Path(service.env["FUSETUNE_ARTIFACT_DIR"]) / "packages" / f"{pkg.digest}.zip"
    with Client(service.url, token=token_of(service)) as client:
        assert client.ensure_package(pkg) is True
        first = stored.stat()
        assert client.ensure_package(ft.package(module.WORKLOAD)) is False  # the same digest: nothing sent
        client.upload_package(pkg)  # sent anyway: the stored object is not written again
        assert client.download_package(pkg.digest) == pkg.data
    assert stored.read_bytes() == pkg.data and stored.stat().st_mtime_ns == first.st_mtime_ns
    assert [p.name for p in stored.parent.iterdir()].count(stored.name) == 1


#: A workload whose model factory (or, with ``where="import"``, its import) waits while a
#: file exists, except in the test's own process.
HELD = '''
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fusetune import Workload

HOLD, MARKER, CLIENT, WHERE = {hold!r}, {marker!r}, {client}, {where!r}


def _hold(where):
    if where == WHERE and os.getpid() != CLIENT:
        with open(MARKER, "a") as f:
            f.write(f"{{os.getpid()}} held\\n")
        while os.path.exists(HOLD):  # the tenant's code takes its time, where it runs
            time.sleep(0.05)


_hold("import")


def build(params):
    _hold("factory")
    return nn.Sequential(nn.Linear(4, int(params.get("hidden", 8))), nn.ReLU(), nn.Linear(int(params.get("hidden", 8)), 2))


def space(trial):
    return {{"lr": trial.suggest_float("lr", 0.01, 0.1, log=True), "hidden": trial.suggest_int("hidden", 4, 8)}}


def data():
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    return TensorDataset(x, y), TensorDataset(x, y)


def accuracy(out, y):
    return float((out.argmax(-1) == y).float().mean())


WORKLOAD = Workload(name="byo-held", build_model=build, search_space=space, datasets=data, loss=F.cross_entropy,
                    metric=accuracy, batch_size=16)
'''


def held_package(tmp_path: Path, where: str = "factory") -> tuple[ft.Package, Path, Path]:
    """The HELD workload packaged, with its hold file in place: the package, the hold and the
    marker a process writes to as it enters the factory (or the import)."""
    hold, marker = tmp_path / "hold", tmp_path / "held"
    hold.touch()
    code = tmp_path / "held-code"
    code.mkdir()
    module = f"byo_held_{uuid.uuid4().hex[:8]}"
    (code / f"{module}.py").write_text(HELD.format(hold=str(hold), marker=str(marker), client=os.getpid(), where=where))
    return ft.package(f"{module}:WORKLOAD", code=code), hold, marker


def held_study(client: Client, pkg: ft.Package, marker: Path, fusion_sampler: bool) -> dict:
    """A study of the held package, once its describer is inside the tenant's factory."""
    client.ensure_package(pkg)
    held = client.submit({"workload": "byo-held", "package": pkg.digest, "n_trials": 4, "epochs": 1, "fusion_sampler": fusion_sampler})
    deadline = time.monotonic() + 600
    while not (marker.exists() and "held" in marker.read_text()):
        assert time.monotonic() < deadline, "the describer never built a model"
        time.sleep(0.05)
    return held


@pytest.mark.parametrize("fusion_sampler", [True, False], ids=["non-fusible-probes", "trial-descriptions"])
def test_a_slow_describer_holds_only_its_own_study(service: ServiceProcess, token: str, tmp_path: Path, fusion_sampler: bool) -> None:
    """A package's code answers the loop in its own time: while its describer is stuck in the
    tenant's model factory (FusionSampler's probes of the space, or the asked trials'
    descriptions), every other study is scheduled and trains to the end; the held study then
    goes on where it was."""
    pkg, hold, marker = held_package(tmp_path)
    with Client(service.url, token=token) as client:
        held = held_study(client, pkg, marker, fusion_sampler)
        other = client.submit({"workload": "digits-mlp", "n_trials": 2, "epochs": 1})
        assert ended(client, other["id"])["state"] == "COMPLETE"
        assert client.study(held["id"])["state"] == "RUNNING"
        assert all(t["state"] == "WAITING" and t["array_id"] is None for t in client.trials(held["id"]))
        hold.unlink()
        done = ended(client, held["id"])
        assert done["state"] == "COMPLETE", done
        assert {t["state"] for t in client.trials(held["id"])} == {"COMPLETE"}


def test_a_trial_enqueued_while_its_package_loads_is_answered_at_once_and_trains_once_it_has(
    service: ServiceProcess, token: str, tmp_path: Path,
) -> None:
    """A client-driven study (optimize) enqueues its first trial while its describer still
    imports the package: the enqueue is answered without waiting for it (it waited the whole
    call timeout on the loop, every study's, and then answered 500), and the trial is
    described and trained once the package has loaded."""
    pkg, hold, marker = held_package(tmp_path, where="import")
    with Client(service.url, token=token) as client:
        client.ensure_package(pkg)
        study = client.submit({"workload": "byo-held", "package": pkg.digest, "n_trials": 1, "epochs": 1, "driver": "client"})
        trial = client.enqueue_trial(study["id"], {"lr": 0.05, "hidden": 6})
        assert trial["state"] == "WAITING" and trial["params"] == {"lr": 0.05, "hidden": 6}
        other = client.submit({"workload": "digits-mlp", "n_trials": 2, "epochs": 1})
        assert ended(client, other["id"])["state"] == "COMPLETE"
        assert "held" in marker.read_text()  # the package was still loading all along
        hold.unlink()
        done = ended(client, study["id"])
        assert done["state"] == "COMPLETE", done
        assert [t["state"] for t in client.trials(study["id"])] == ["COMPLETE"]


def test_trials_a_killed_service_left_undescribed_are_described_by_the_next(tmp_path: Path) -> None:
    """The rows are the record: trials asked and written, whose describer had not answered
    when the whole service was killed, are described again by the service that follows."""
    pkg, hold, marker = held_package(tmp_path)
    admin = secrets.token_urlsafe(24)
    first = ServiceProcess(service_env(tmp_path), tmp_path / "first.log", admin).start()
    second = ServiceProcess(service_env(tmp_path), tmp_path / "second.log", admin)
    try:
        first.healthy()
        with Client(first.url, token=admin) as client:
            client.set_code_upload("default", True)
            held = held_study(client, pkg, marker, fusion_sampler=False)
            asked = client.trials(held["id"])
            assert asked and all(t["state"] == "WAITING" for t in asked)
        first.kill9()
        hold.unlink()
        second.start().healthy()
        with Client(second.url, token=admin) as client:
            done = ended(client, held["id"])
            assert done["state"] == "COMPLETE", (done, second.log_tail())
            assert {t["id"] for t in client.trials(held["id"])} == {t["id"] for t in asked}
    finally:
        first.stop()
        second.stop()


def test_after_a_restart_a_package_study_waits_for_its_describer_and_holds_no_one_else(tmp_path: Path) -> None:
    """Its trials were described before the service was killed; the next service places them
    only once the package's describer has answered again (its FusionSampler's probes, held
    here in the tenant's factory), and meanwhile another study gets the one worker and trains
    to the end."""
    pkg, hold, marker = held_package(tmp_path)
    hold.unlink()  # the first service describes and starts the sweep unhindered
    admin = secrets.token_urlsafe(24)
    first = ServiceProcess(service_env(tmp_path), tmp_path / "first.log", admin).start()
    second = ServiceProcess(service_env(tmp_path), tmp_path / "second.log", admin)
    try:
        first.healthy()
        with Client(first.url, token=admin) as client:
            client.set_code_upload("default", True)
            client.ensure_package(pkg)
            held = client.submit({"workload": "byo-held", "package": pkg.digest, "n_trials": 4, "epochs": 200})
            deadline = time.monotonic() + 600
            while not any(t["intermediate_values"] for t in client.trials(held["id"])):  # it trains
                assert time.monotonic() < deadline, first.log_tail()
                time.sleep(0.1)
        first.kill9()
        hold.touch()
        marker.unlink()
        second.start().healthy()
        with Client(second.url, token=admin) as client:
            other = client.submit({"workload": "digits-mlp", "n_trials": 2, "epochs": 1})
            assert ended(client, other["id"])["state"] == "COMPLETE", second.log_tail()
            assert "held" in marker.read_text()  # the describer is in the factory: nothing trained the held study
            assert all(t["state"] == "WAITING" for t in client.trials(held["id"]))
            hold.unlink()
            client.cancel_study(held["id"])  # 200 epochs: it has shown what it had to
            assert ended(client, held["id"])["state"] == "CANCELLED"
    finally:
        first.stop()
        second.stop()


def test_more_packages_than_describers_take_turns_and_one_that_never_loads_times_out(tmp_path: Path) -> None:
    """Two describer places, four packages: a package waits for a place rather than stop one
    still loading (each start stopped another, and none ever loaded), and a package whose
    import never returns fails its study after FUSETUNE_PACKAGE_LOAD_TIMEOUT_S (shortened
    here) instead of holding its place for ever."""
    (tmp_path / "stuck").mkdir()
    stuck, _, _ = held_package(tmp_path / "stuck", where="import")  # its hold file is never removed
    admin = secrets.token_urlsafe(24)
    env = {**service_env(tmp_path), "FUSETUNE_PACKAGE_DESCRIBERS": "2", "FUSETUNE_PACKAGE_LOAD_TIMEOUT_S": "60"}
    server = ServiceProcess(env, tmp_path / "service.log", admin).start()
    try:
        server.healthy()
        with Client(server.url, token=admin) as client:
            client.set_code_upload("default", True)
            client.ensure_package(stuck)
            never = client.submit({"workload": "byo-held", "package": stuck.digest, "n_trials": 2, "epochs": 1})
            names = []
            for k in range(3):
                module = imported(tmp_path / f"code{k}", write_module(tmp_path / f"code{k}", tmp_path / "marker", name=f"byo-turn{k}"))
                names.append(ft.create_study(workload=module.WORKLOAD, n_trials=2, epochs=1, url=server.url, token=admin).study_name)
            rows = {s["name"]: s["id"] for s in client.studies()}
            for name in names:
                assert ended(client, rows[name])["state"] == "COMPLETE", server.log_tail()
            failed = ended(client, never["id"])
            assert failed["state"] == "FAILED" and "FUSETUNE_PACKAGE_LOAD_TIMEOUT_S" in failed["error"], failed["error"]
    finally:
        server.stop()


def token_of(service: ServiceProcess) -> str:
    return service.token()


@pytest.mark.parametrize("example", ["residual_cnn.py", "transformer_lm.py"])
def test_the_examples_run_as_programs_against_the_service(service: ServiceProcess, token: str, example: str) -> None:
    """docs/examples/: each is a complete program; it packages its own workload, uploads it and
    waits for its sweep, which the service trains fused."""
    program = Path(__file__).parents[1] / "docs" / "examples" / example
    done = subprocess.run(
        [sys.executable, str(program), "--url", service.url, "--token", token, "--trials", "4", "--epochs", "1"],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "study COMPLETE" in done.stdout and "best trial #" in done.stdout, done.stdout
    with Client(service.url, token=token) as client:
        (study,) = [s for s in client.studies() if s["name"] in done.stdout.splitlines()[0]]
        assert study["package"] and study["warnings"] == [], study
        arrays = {t["array_id"] for t in client.trials(study["id"])}
        assert None not in arrays and len(arrays) < 4, arrays  # trials shared arrays: fused
