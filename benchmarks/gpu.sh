#!/usr/bin/env bash
# The GPU checks as one run, for a session lent a CUDA machine (docs/benchmarks.md):
#
#   bash benchmarks/gpu.sh [OUTDIR]        # default: $OUT, else /tmp/fusetune-gpu
#   MODELS=pointnet MEMBERS=1,8 bash benchmarks/gpu.sh   # a subset
#
# It runs the CUDA tests, the out-of-memory split, the fusion benchmark at B up to 64, and what
# array sizing picks there. It needs only python3 with torch, pytest, scikit-learn and pyarrow
# (the machine's own, not the project's venv), plus optuna and colorlog, as wheels in .whl/
# where the machine lacks them. Fetch those here, for the device's Python 3.12, and carry .whl:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl optuna==5.1.0 colorlog
#
# Last, when a GPU is there, the end-to-end sweep of a user's own workload at ResNet-18 size
# (benchmarks/_resnet18.py: the residual CNN example's data, augmentation and space, 64 trials x
# 5 epochs, 3 seeds) against Ray Tune with fractional GPUs (RAYTUNE_GPU of a GPU a trial,
# default 0.125: 8 trials share it): `e2e.py --workload resnet18`, on SQLite. That step runs
# the service, so it also needs the service's dependencies and ray[tune] (pyproject's
# dependencies and its bench extra); where they do not import it says which are missing and
# is skipped. It has not been run yet: no session so far had a GPU for it (docs/benchmarks.md).
set -uo pipefail
out=${1:-${OUT:-/tmp/fusetune-gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests/fusion${PYTHONPATH:+:$PYTHONPATH}"
# A CUDA image has torch but not this project installed, and may reach no package index.
# Wheels put in .whl/ beforehand (the workloads import optuna) are unpacked beside it...
if ! $py -c "import optuna" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fusetune-site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/fusetune-site"
fi
# ...and the `fusetune` namespace is a folder of links to the repository's folders, as
# pyproject's package-dir maps them.
if ! $py -c "import fusetune.fusion" 2>/dev/null; then
  ns=$(mktemp -d)
  mkdir "$ns/fusetune"
  for d in fusion workers scheduler client server migrations; do ln -s "$PWD/$d" "$ns/fusetune/$d"; done
  ln -s "$PWD/client/_top/__init__.py" "$ns/fusetune/__init__.py"  # the package's own module (pyproject: package-dir)
  export PYTHONPATH="$ns:$PYTHONPATH"
fi
members=${MEMBERS:-1,2,4,8,16,32,64}
models=${MODELS:-mlp,cnn,resnet,transformer,lstm,pointnet}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c "import torch; print(torch.__version__)"; } \
  > "$out/gpu.txt" 2>&1
# --noconftest: the suite's conftest starts databases and Ray, which the CUDA tests do not use.
$py -m pytest --noconftest -p no:cacheprovider -q -rs tests/fusion/test_fusion_cuda.py 2>&1 | tee "$out/cuda_tests.txt"
# Out of memory: an array that runs out of CUDA memory is split and its halves train (issue 12).
$py -m pytest --noconftest -p no:cacheprovider -q -rs tests/workers/test_oom_cuda.py 2>&1 | tee "$out/oom_tests.txt"
$py benchmarks/fusion.py --device cuda --models "$models" --members "$members" --steps 10 --rounds 5 2>&1 | tee "$out/fusion_cuda.txt"
$py benchmarks/fusion.py --device cuda --sizing --models "$models" --members "$members" 2>&1 | tee "$out/sizing_cuda.txt"
# A user's workload end to end on the GPU (issue 31): fusetune's fused arrays against Ray Tune's
# fractional GPUs, the same code on both sides.
if nvidia-smi -L >/dev/null 2>&1 && $py -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  missing=$($py - <<'PY'
import importlib.util
mods = ["ray", "ray.tune", "fastapi", "uvicorn", "sqlalchemy", "alembic", "pydantic_settings", "httpx", "sse_starlette",
        "prometheus_client", "pyarrow", "filelock", "cloudpickle", "pathspec", "packaging", "scipy", "sklearn", "optuna"]
def found(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(m for m in mods if not found(m)))
PY
)
  if [ -z "$missing" ]; then
    $py benchmarks/e2e.py --workload resnet18 --backends sqlite --systems fusetune,raytune --seeds "${SEEDS:-0,1,2}" \
      --raytune-gpu "${RAYTUNE_GPU:-0.125}" --json "$out/e2e_resnet18.json" 2>&1 | tee "$out/e2e_resnet18.txt"
  else
    echo "e2e --workload resnet18 skipped: $py lacks $missing (pyproject's dependencies and ray[tune])" | tee "$out/e2e_resnet18.txt"
  fi
fi
