"""`pip install .` gives one `fusetune` package and no top-level `server`, `client`, ... modules."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("server", "client", "fusion", "workers", "scheduler", "migrations")


def test_every_folder_with_an_init_is_a_listed_subpackage() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    # Each folder's package, through package-dir (`fusetune` itself is client/_top).
    folders = {tuple(Path(folder).parts): package for package, folder in setuptools["package-dir"].items()}

    def package_of(folder: Path) -> str:
        parts = folder.relative_to(ROOT).parts
        for cut in range(len(parts), 0, -1):
            if parts[:cut] in folders:
                return ".".join([folders[parts[:cut]], *parts[cut:]])
        raise AssertionError(f"{folder} is under no package-dir entry")

    on_disk = {
        package_of(init.parent)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert listed == on_disk


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("fusetune-*.whl")
    return found


def test_the_wheel_holds_only_the_fusetune_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fusetune", next(t for t in tops if t.endswith(".dist-info"))}
    assert "fusetune/migrations/script.py.mako" in names
    assert "fusetune/server/cli.py" in names
    assert "fusetune/__init__.py" in names  # from fusetune import Workload, Metric
    assert not any(n.startswith("fusetune/client/_top") for n in names)
    # The dashboard's page, its modules and the vendored libraries with their licences.
    for data in (
        "fusetune/server/dashboard/static/index.html",
        "fusetune/server/dashboard/static/app.js",
        "fusetune/server/dashboard/static/views/study.js",
        "fusetune/server/dashboard/vendor/echarts-6.1.0/echarts.esm.min.js",
        "fusetune/server/dashboard/vendor/echarts-6.1.0/LICENSE",
        "fusetune/server/dashboard/vendor/uplot-1.6.32/uPlot.esm.js",
        "fusetune/server/dashboard/vendor/uplot-1.6.32/LICENSE",
    ):
        assert data in names, data


def test_a_fresh_venv_imports_fusetune_and_runs_the_command(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", str(wheel)], check=True, capture_output=True)
    # The dependencies (torch, ray, ...) come from this environment's site-packages, added
    # as a plain path: its .pth files, including the editable install's finder, stay unread.
    (site,) = (env_dir / "lib").glob("python*/site-packages")
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = (
        "import sys, importlib.util, fusetune.client\n"
        "print('torch' in sys.modules)\n"  # the top-level module's names are lazy
        "import fusetune.fusion, fusetune.server.app, fusetune.workers.actor\n"
        f"print([m for m in {FOLDERS!r} if importlib.util.find_spec(m)])\n"
        "print(fusetune.fusion.__file__)\n"
        "from fusetune import Metric, Workload\n"
        "print(Workload.__module__, Metric.__module__)\n"
    )
    done = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    torch_imported, top_level, fusion_file, protocol = done.stdout.split("\n")[:4]
    assert torch_imported == "False"
    assert top_level == "[]"
    assert fusion_file.startswith(str(site))
    assert protocol == "fusetune.workers.workloads._base fusetune.workers.workloads._base"
    help_text = subprocess.run(
        [env_dir / "bin" / "fusetune", "--help"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert "serve" in help_text
