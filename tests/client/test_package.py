"""fusetune.client.package: a user's own workload as the code package the service takes.

Read as the spec of packaging, with real files, real imports and a real second interpreter:

* the zip is deterministic: the same code gives the same bytes and digest, whatever the files'
  timestamps and modes; a changed file (and a changed workload) changes it;
* a code folder is read as Ray reads a ``working_dir``: ``DEFAULT_EXCLUDES`` and the caller's
  gitignore patterns are left out; the service's limits are checked before any upload, and a
  refusal names the setting; a file would not clash with the package's own ``fusetune.json``;
* a ``Workload`` object is cloudpickled *by value*: an interpreter that cannot import the
  user's modules unpickles it, builds its model and reads its datasets;
* a ``module:attr`` path inside ``code=DIR`` is named by the manifest's ``entry``, read from
  the files as they are now;
* the define-by-run space is stated as static distributions, a conditional one refused (or
  its union, for ``optimize``);
* every manifest the client makes is one the service takes (``fusetune.server.packages``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import io
import json
import os
import subprocess
import sys
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from fusetune.client import ConditionalSearchSpaceError, Package, package, static_search_space
from fusetune.client._package import (
    DEFAULT_EXCLUDES,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_FILES,
    DEFAULT_MAX_UNPACKED_BYTES,
    MANIFEST,
    PICKLE,
)
from fusetune.server.packages import Limits, Manifest, check_package
from fusetune.server.settings import Settings
from fusetune.workers.workloads import get_workload

# -- a user's workload, as files ----------------------------------------------------------------

HELPERS = '''
import torch

SEED = 3


def make_data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g)
'''

WORKLOAD = '''
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import {helpers} as helpers
from {helpers} import SEED

from fusetune import Metric, Workload


class Tiny(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x):
        return self.body(x)


class Rows(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def build(params):
    return Tiny(int(params["hidden"]))


def space(trial):
    {space}


def data():
    x, y = helpers.make_data(SEED)
    return Rows(x[:24], y[:24]), TensorDataset(x[24:], y[24:])


def accuracy(output, target):
    return float((output.argmax(-1) == target).float().mean())


WORKLOAD = Workload(
    name={name!r}, build_model=build, search_space=space, datasets=data,
    loss=nn.functional.cross_entropy, metric=accuracy,
    metrics=(Metric("n_params", lambda m: float(sum(p.numel() for p in m.parameters())), "minimize", of="model"),),
    optimizer="Adam", optimizer_defaults={{"lr": 0.01}}, batch_size=8, description="a user's own",
)
'''

STATIC_SPACE = (
    'return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True), '
    '"hidden": trial.suggest_categorical("hidden", [8, 16])}'
)
STATIC_DISTRIBUTIONS = {
    "lr": FloatDistribution(1e-3, 1e-1, log=True),
    "hidden": CategoricalDistribution([8, 16]),
}
#: The service's limits as it runs by default (its settings' defaults, not this environment's).
LIMITS = Limits(
    max_bytes=Settings.model_fields["package_max_bytes"].default,
    max_files=Settings.model_fields["package_max_files"].default,
    max_unpacked_bytes=Settings.model_fields["package_max_unpacked_bytes"].default,
)




def write_workload(folder: Path, module: str, *, name: str = "user-tiny", space: str = STATIC_SPACE) -> Path:
    """``folder/<module>.py`` defining ``WORKLOAD`` (and its helpers module beside it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}_helpers.py").write_text(HELPERS)
    path = folder / f"{module}.py"
    path.write_text(WORKLOAD.format(helpers=f"{module}_helpers", space=space, name=name))
    return path


def unique(prefix: str) -> str:
    """A module name no other test (nor a rerun in this process) imports."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def forget_imports(tmp_path: Path) -> Iterator[None]:
    """What a test imports from its tmp_path is gone afterwards: sys.path and sys.modules as before."""
    path = list(sys.path)
    yield
    sys.path[:] = path
    root = os.path.realpath(tmp_path) + os.sep
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if where and os.path.realpath(where).startswith(root):
            del sys.modules[name]


def imported(folder: Path, module: str) -> ModuleType:
    """``module`` imported from ``folder``, as a user's script imports its own modules."""
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(folder))


def entries(pkg: Package) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(pkg.data)) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def the_service_takes(pkg: Package) -> Manifest:
    """The package as the service checks it on upload, without importing anything: its
    manifest validates, and ``check_package`` accepts the bytes under the default limits."""
    manifest = Manifest.model_validate_json(entries(pkg)[MANIFEST])
    assert manifest == Manifest.model_validate(pkg.manifest)
    checked = check_package(pkg.data, pkg.digest, LIMITS)
    assert checked.manifest == manifest and checked.size_bytes == len(pkg.data)
    assert checked.files == len(entries(pkg))
    return manifest


# -- (a) deterministic bytes ----------------------------------------------------------------------


def test_the_same_code_packages_to_the_same_bytes_and_a_change_to_another_digest(tmp_path: Path) -> None:
    code = tmp_path / "code"
    module = unique("wl_same")
    write_workload(code, module)
    (code / "data.csv").write_text("x,y\n1,2\n")
    first = package(f"{module}:WORKLOAD", code=code)
    again = package(f"{module}:WORKLOAD", code=code)
    assert again.data == first.data and again.digest == first.digest == hashlib.sha256(first.data).hexdigest()

    # Timestamps and modes are not the code: the zip records one of each.
    for path in code.iterdir():
        os.utime(path, (1_700_000_000, 1_700_000_000))
    (code / "data.csv").chmod(0o600)
    assert package(f"{module}:WORKLOAD", code=code).digest == first.digest
    with zipfile.ZipFile(io.BytesIO(first.data)) as archive:
        infos = archive.infolist()
    assert [i.filename for i in infos] == sorted(i.filename for i in infos)
    assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
    assert {i.external_attr >> 16 for i in infos} == {0o100644}

    (code / "data.csv").write_text("x,y\n1,3\n")
    changed = package(f"{module}:WORKLOAD", code=code)
    assert changed.digest != first.digest and entries(changed)["data.csv"] == b"x,y\n1,3\n"
    the_service_takes(first)
    the_service_takes(changed)


def test_a_workload_object_packages_to_the_same_bytes_twice(tmp_path: Path) -> None:
    module = unique("wl_obj")
    write_workload(tmp_path / "src", module)
    workload = imported(tmp_path / "src", module).WORKLOAD
    first = package(workload, requirements=["numpy>=1"])
    assert package(workload, requirements=["numpy>=1"]).data == first.data
    assert package(workload, requirements=["numpy>=2"]).digest != first.digest


def test_an_edited_module_is_packaged_as_it_is_now_and_the_process_keeps_its_own(tmp_path: Path) -> None:
    """A notebook imported its workload's module, then edited the file: the package (zip and
    manifest alike) is the edit, and the notebook's module object is untouched."""
    code = tmp_path / "code"
    module = unique("wl_edit")
    path = write_workload(code, module)
    mine = imported(code, module)
    before = package(f"{module}:WORKLOAD", code=code)
    assert before.workload_name == "user-tiny"
    assert set(before.manifest["search_space"]) == {"lr", "hidden"}

    edited = STATIC_SPACE.replace('"hidden": ', '"momentum": trial.suggest_float("momentum", 0.0, 0.9), "hidden": ')
    path.write_text(WORKLOAD.format(helpers=f"{module}_helpers", space=edited, name="user-tiny-2"))
    after = package(f"{module}:WORKLOAD", code=code)
    assert after.workload_name == "user-tiny-2" and after.manifest["workload"]["name"] == "user-tiny-2"
    assert set(after.manifest["search_space"]) == {"lr", "hidden", "momentum"}
    assert b"user-tiny-2" in entries(after)[f"{module}.py"]
    assert sys.modules[module] is mine and mine.WORKLOAD.name == "user-tiny"
    the_service_takes(after)


# -- (b) what a code folder holds, and the limits ----------------------------------------------------


def test_default_excludes_and_the_callers_gitignore_patterns_leave_files_out(tmp_path: Path) -> None:
    code = tmp_path / "code"
    module = unique("wl_excl")
    write_workload(code, module)
    for name in (
        ".git/config", "__pycache__/x.cpython-311.pyc", "pkg/__pycache__/y.pyc", "stray.pyc",
        ".venv/lib/site.py", "node_modules/left/index.js",  # DEFAULT_EXCLUDES
        "data/train.bin", "pkg/data/kept.txt", "secrets.env", "logs/a.log", "run.log", "important.log",  # the caller's
        "pkg/__init__.py", "README.md", ".gitignore",  # kept
    ):
        (code / name).parent.mkdir(parents=True, exist_ok=True)
        (code / name).write_text(name)
    assert DEFAULT_EXCLUDES == (".git", "__pycache__", "*.pyc", ".venv", "node_modules")
    pkg = package(f"{module}:WORKLOAD", code=code, excludes=["/data/", "*.env", "*.log", "!important.log"])
    assert set(entries(pkg)) == {
        MANIFEST, f"{module}.py", f"{module}_helpers.py",
        "pkg/__init__.py", "pkg/data/kept.txt", "README.md", ".gitignore", "important.log",
    }
    the_service_takes(pkg)


def test_symlinks_are_followed_as_ray_follows_them_and_a_loop_ends(tmp_path: Path) -> None:
    """A ``data/`` linked into the folder from elsewhere is packaged with it (Ray's
    ``working_dir`` follows links too); a link back up the tree is not walked again."""
    code = tmp_path / "code"
    module = unique("wl_links")
    write_workload(code, module)
    elsewhere = tmp_path / "datasets" / "digits"
    elsewhere.mkdir(parents=True)
    (elsewhere / "train.csv").write_text("1,2\n")
    (code / "data").symlink_to(elsewhere, target_is_directory=True)
    (code / "pkg").mkdir()
    (code / "pkg" / "up").symlink_to(code, target_is_directory=True)  # a loop
    (code / "pkg" / "again").symlink_to(elsewhere, target_is_directory=True)  # the same folder twice
    (code / "notes.txt").symlink_to(elsewhere / "train.csv")
    pkg = package(f"{module}:WORKLOAD", code=code)
    assert set(entries(pkg)) == {MANIFEST, f"{module}.py", f"{module}_helpers.py", "data/train.csv", "notes.txt"}
    the_service_takes(pkg)


def test_a_misspelt_optimizer_or_scheduler_default_is_refused_before_upload_naming_it() -> None:
    """As the service refuses a study's ``optimizer.kwargs``: here, not in every trial."""
    base = get_workload("digits-mlp")
    with pytest.raises(ValueError, match=r"workload 'digits-mlp': optimizer SGD has no argument 'momentun' \(optimizer_defaults\)"):
        package(dataclasses.replace(base, optimizer_defaults={"lr": 0.1, "momentun": 0.9}))
    with pytest.raises(ValueError, match=r"StepLR has no argument 'step_sise' \(lr_scheduler_defaults\)"):
        package(dataclasses.replace(base, lr_scheduler="StepLR", lr_scheduler_defaults={"step_sise": 2}))
    with pytest.raises(ValueError, match="lr"):
        package(dataclasses.replace(base, optimizer_defaults={"lr": -1.0}))


def test_the_services_limits_are_checked_here_naming_the_setting(tmp_path: Path) -> None:
    # The client's defaults are the service's.
    assert (DEFAULT_MAX_BYTES, DEFAULT_MAX_FILES, DEFAULT_MAX_UNPACKED_BYTES) == (
        LIMITS.max_bytes, LIMITS.max_files, LIMITS.max_unpacked_bytes,
    )
    code = tmp_path / "code"
    module = unique("wl_big")
    write_workload(code, module)
    (code / "weights.bin").write_bytes(os.urandom(50_000))
    path = f"{module}:WORKLOAD"
    with pytest.raises(ValueError, match="FUSETUNE_PACKAGE_MAX_UNPACKED_BYTES") as folder:
        package(path, code=code, max_unpacked_bytes=20_000)
    assert "code=" in str(folder.value) and "excludes" in str(folder.value)
    with pytest.raises(ValueError, match="FUSETUNE_PACKAGE_MAX_FILES"):
        package(path, code=code, max_files=2)
    with pytest.raises(ValueError, match="FUSETUNE_PACKAGE_MAX_BYTES"):
        package(path, code=code, max_bytes=20_000)  # random bytes do not deflate
    # Left out, the same folder fits.
    small = package(path, code=code, excludes=["*.bin"], max_bytes=20_000, max_unpacked_bytes=20_000, max_files=3)
    assert "weights.bin" not in entries(small)
    the_service_takes(small)
    # A workload object's pickle counts as well.
    workload = imported(code, module).WORKLOAD
    with pytest.raises(ValueError, match="FUSETUNE_PACKAGE_MAX_BYTES"):
        package(workload, max_bytes=100)


def test_a_file_would_clash_with_the_packages_own_names(tmp_path: Path) -> None:
    code = tmp_path / "code"
    module = unique("wl_clash")
    write_workload(code, module)
    (code / MANIFEST).write_text("{}")
    with pytest.raises(ValueError, match=MANIFEST):
        package(f"{module}:WORKLOAD", code=code)
    excluded = package(f"{module}:WORKLOAD", code=code, excludes=[f"/{MANIFEST}"])
    assert json.loads(entries(excluded)[MANIFEST]) == excluded.manifest  # the package's own
    (code / MANIFEST).unlink()
    (code / PICKLE).write_bytes(b"not mine")
    workload = imported(code, module).WORKLOAD
    with pytest.raises(ValueError, match=PICKLE):
        package(workload, code=code)


# -- (c) a Workload object, pickled by value ---------------------------------------------------------

UNPICKLE = """
import importlib.util, json, pickle, sys, zipfile
zip_path, *modules = sys.argv[1:]
importable = [m for m in modules if importlib.util.find_spec(m) is not None]
with zipfile.ZipFile(zip_path) as archive:
    manifest = json.loads(archive.read("fusetune.json"))
    workload = pickle.loads(archive.read(manifest["pickle"]))
import torch
from fusetune import Workload
model = workload.build_model({"hidden": 16, "lr": 0.01})
train, validation = workload.datasets()
x = torch.stack([train[i][0] for i in range(len(train))])
y = torch.stack([train[i][1] for i in range(len(train))])
out = model(x)
print(json.dumps({
    "importable": importable,
    "imported": [m for m in modules if m in sys.modules],
    "is_workload": isinstance(workload, Workload),
    "name": workload.name,
    "model": type(model).__name__,
    "out": list(out.shape),
    "loss": float(workload.loss(out, y)),
    "n_params": workload.metric_named("n_params").fn(model),
    "sizes": [len(train), len(validation)],
    "first": x[0].tolist(),
    "dataset": type(train).__name__,
}))
"""


def test_a_workload_object_is_pickled_by_value_and_runs_where_its_modules_are_not(tmp_path: Path) -> None:
    module = unique("wl_byval")
    helpers = f"{module}_helpers"
    write_workload(tmp_path / "src", module)
    user = imported(tmp_path / "src", module)
    pkg = package(user.WORKLOAD, requirements=["numpy"])
    x, _ = sys.modules[helpers].make_data(sys.modules[helpers].SEED)
    expected_params = sum(p.numel() for p in user.build({"hidden": 16}).parameters())
    # The user's modules are gone from this process too: the pickle holds their code.
    assert str(tmp_path / "src") not in sys.path
    for name in (module, helpers):
        del sys.modules[name]

    manifest = the_service_takes(pkg)
    assert manifest.pickle == PICKLE and manifest.entry is None
    assert set(entries(pkg)) == {MANIFEST, PICKLE}
    assert manifest.requirements == ["numpy"]
    assert manifest.python == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert manifest.workload.name == "user-tiny" and manifest.workload.optimizer == "Adam"
    assert [(m.name, m.direction, m.of) for m in manifest.workload.metrics] == [
        ("accuracy", "maximize", "outputs"), ("n_params", "minimize", "model"),
    ]
    assert manifest.distributions() == STATIC_DISTRIBUTIONS

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "package.zip").write_bytes(pkg.data)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    done = subprocess.run(
        [sys.executable, "-c", UNPICKLE, "package.zip", module, helpers],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["importable"] == [], "the user's modules must not be importable where the package is unpickled"
    assert seen["imported"] == [], "unpickling imported the user's modules instead of reading them from the pickle"
    assert seen["is_workload"] and seen["name"] == "user-tiny"
    assert seen["model"] == "Tiny" and seen["out"] == [24, 3] and seen["loss"] > 0
    assert seen["n_params"] == expected_params
    assert seen["sizes"] == [24, 8] and seen["dataset"] == "Rows"
    assert seen["first"] == pytest.approx(x[0].tolist())


# -- (d) a module:attr path in code=DIR ---------------------------------------------------------------


def test_a_path_in_a_code_folder_is_the_manifests_entry(tmp_path: Path) -> None:
    code = tmp_path / "code"
    package_name = unique("userpkg")
    write_workload(code / package_name, "model")
    (code / package_name / "__init__.py").write_text("")
    # Inside a package its helpers module is imported by its full name.
    source = (code / package_name / "model.py").read_text()
    (code / package_name / "model.py").write_text(source.replace("model_helpers", f"{package_name}.model_helpers"))
    pkg = package(f"{package_name}.model:WORKLOAD", code=code, requirements=["scipy>=1.10"])
    manifest = the_service_takes(pkg)
    assert manifest.entry == f"{package_name}.model:WORKLOAD" and manifest.pickle is None
    assert set(entries(pkg)) == {
        MANIFEST, f"{package_name}/__init__.py", f"{package_name}/model.py", f"{package_name}/model_helpers.py",
    }
    assert entries(pkg)[f"{package_name}/model.py"] == (code / package_name / "model.py").read_bytes()
    assert manifest.workload.name == "user-tiny" and manifest.requirements == ["scipy>=1.10"]
    assert manifest.distributions() == STATIC_DISTRIBUTIONS


def test_a_path_needs_its_folder_and_must_be_in_it(tmp_path: Path) -> None:
    code = tmp_path / "code"
    module = unique("wl_path")
    write_workload(code, module)
    with pytest.raises(ValueError, match="code=DIR"):
        package(f"{module}:WORKLOAD")
    with pytest.raises(ValueError, match="module:attr"):
        package(module, code=code)
    with pytest.raises(ValueError, match="no module"):
        package(f"{module}_absent:WORKLOAD", code=code)
    with pytest.raises(ValueError, match="has no 'NOT_THERE'"):
        package(f"{module}:NOT_THERE", code=code)
    with pytest.raises(TypeError, match="not a fusetune Workload"):
        package(f"{module}:build", code=code)
    with pytest.raises(ValueError, match="not a folder"):
        package(f"{module}:WORKLOAD", code=code / f"{module}.py")


def test_a_module_imported_from_elsewhere_shadows_the_folders_and_is_refused(tmp_path: Path) -> None:
    module = unique("wl_shadow")
    write_workload(tmp_path / "theirs", module)
    write_workload(tmp_path / "code", module, name="mine")
    imported(tmp_path / "theirs", module)  # the process has a module of that name already
    with pytest.raises(ValueError, match="imported from .*theirs.*rename it"):
        package(f"{module}:WORKLOAD", code=tmp_path / "code")
    # A name the standard library holds is no module of the folder either.
    (tmp_path / "code" / "json.py").write_text("WORKLOAD = None\n")
    with pytest.raises(ValueError, match="'json' is imported from"):
        package("json:WORKLOAD", code=tmp_path / "code")


# -- (e) the search space, stated as static distributions ------------------------------------------


def static(trial: optuna.Trial) -> dict[str, Any]:
    return {
        "lr": trial.suggest_float("lr", 1e-4, 1e-1, log=True),
        "layers": trial.suggest_int("layers", 1, 4),
        "optimizer": trial.suggest_categorical("optimizer", ["SGD", "Adam"]),
    }


def branches_on_a_choice(trial: optuna.Trial) -> dict[str, Any]:
    kind = trial.suggest_categorical("kind", ["mlp", "cnn"])
    if kind == "mlp":
        return {"kind": kind, "hidden": trial.suggest_int("hidden", 8, 64)}
    return {"kind": kind, "channels": trial.suggest_int("channels", 4, 16)}


def branches_at_a_ranges_end(trial: optuna.Trial) -> dict[str, Any]:
    params = {"dropout": trial.suggest_float("dropout", 0.0, 0.5)}
    if params["dropout"] == 0.0:  # random sampling never draws it; the probe of the range's low end does
        params["bias"] = trial.suggest_categorical("bias", [True, False])
    return params


def one_param_two_ways(trial: optuna.Trial) -> dict[str, Any]:
    kind = trial.suggest_categorical("kind", ["small", "large"])
    return {"kind": kind, "width": trial.suggest_int("width", 8, 16 if kind == "small" else 256)}


def derives_a_value(trial: optuna.Trial) -> dict[str, Any]:
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1), "hidden": 2 ** trial.suggest_int("log_hidden", 3, 6)}


def test_a_static_space_gives_its_distributions() -> None:
    assert static_search_space(static) == {
        "lr": FloatDistribution(1e-4, 1e-1, log=True),
        "layers": IntDistribution(1, 4),
        "optimizer": CategoricalDistribution(["SGD", "Adam"]),
    }


@pytest.mark.parametrize("space", [branches_on_a_choice, branches_at_a_ranges_end])
def test_a_conditional_space_is_refused_pointing_at_optimize(space: Any) -> None:
    with pytest.raises(ConditionalSearchSpaceError, match=r"fusetune\.client\.optimize") as refused:
        static_search_space(space)
    assert isinstance(refused.value, ValueError)
    assert "conditional" in str(refused.value)


def test_a_conditional_space_as_its_union() -> None:
    assert static_search_space(branches_on_a_choice, union=True) == {
        "kind": CategoricalDistribution(["mlp", "cnn"]),
        "hidden": IntDistribution(8, 64),
        "channels": IntDistribution(4, 16),
    }
    assert static_search_space(branches_at_a_ranges_end, union=True) == {
        "dropout": FloatDistribution(0.0, 0.5),
        "bias": CategoricalDistribution([True, False]),
    }
    # No union of one param's two distributions.
    with pytest.raises(ConditionalSearchSpaceError, match="width"):
        static_search_space(one_param_two_ways, union=True)


def test_a_space_returning_what_it_did_not_suggest_is_refused() -> None:
    """In create_study and in optimize alike (``union``), with an error that sends the user
    to build_model, not to optimize: each trial trains with what its space suggested."""
    for union in (False, True):
        with pytest.raises(ConditionalSearchSpaceError, match="hidden") as refused:
            static_search_space(derives_a_value, union=union)
        assert "in build_model instead" in str(refused.value) and "optimize," not in str(refused.value)


def test_package_states_the_space_refuses_a_conditional_one_or_takes_the_callers(tmp_path: Path) -> None:
    code = tmp_path / "code"
    module = unique("wl_space")
    conditional = (
        'kind = trial.suggest_categorical("kind", ["a", "b"])\n'
        '    extra = {"lr": trial.suggest_float("lr", 1e-3, 1e-1)} if kind == "a" else {}\n'
        '    return {"kind": kind, "hidden": trial.suggest_categorical("hidden", [8, 16]), **extra}'
    )
    write_workload(code, module, space=conditional)
    path = f"{module}:WORKLOAD"
    with pytest.raises(ConditionalSearchSpaceError, match=r"fusetune\.client\.optimize"):
        package(path, code=code)
    union = package(path, code=code, conditional=True)
    assert the_service_takes(union).distributions() == {
        "kind": CategoricalDistribution(["a", "b"]), "hidden": CategoricalDistribution([8, 16]),
        "lr": FloatDistribution(1e-3, 1e-1),
    }
    fixed = {"hidden": CategoricalDistribution([8]), "lr": FloatDistribution(0.01, 0.02)}
    given = package(path, code=code, search_space=fixed)
    assert the_service_takes(given).distributions() == fixed
    with pytest.raises(ValueError, match="suggests no params"):
        package(path, code=code, search_space={})


# -- (g) the top-level names ---------------------------------------------------------------------------


def test_fusetune_workload_and_metric_are_the_workers_classes() -> None:
    import fusetune
    from fusetune import Metric, Workload
    from fusetune.workers import workloads

    assert Workload is workloads.Workload and Metric is workloads.Metric
    assert fusetune.Workload is Workload and {"Workload", "Metric"} <= set(dir(fusetune))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        fusetune.Nope  # noqa: B018


def test_a_workload_holding_what_cannot_be_pickled_names_the_field() -> None:
    import threading

    lock = threading.Lock()
    base = get_workload("digits-mlp")

    def datasets() -> Any:
        with lock:
            return base.datasets()

    with pytest.raises(TypeError, match="workload 'digits-mlp' cannot be sent by value: its datasets holds what cannot be pickled"):
        package(dataclasses.replace(base, datasets=datasets))
