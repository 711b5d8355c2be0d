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
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        "fusetune." + ".".join(init.parent.relative_to(ROOT).parts)
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
        "import importlib.util, fusetune.client, fusetune.fusion, fusetune.server.app, fusetune.workers.actor\n"
        f"print([m for m in {FOLDERS!r} if importlib.util.find_spec(m)])\n"
        "print(fusetune.fusion.__file__)\n"
    )
    done = subprocess.run([python, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    top_level, fusion_file = done.stdout.split("\n")[:2]
    assert top_level == "[]"
    assert fusion_file.startswith(str(site))
    help_text = subprocess.run(
        [env_dir / "bin" / "fusetune", "--help"], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert "serve" in help_text
