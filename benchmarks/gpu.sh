#!/usr/bin/env bash
# The GPU checks as one run, for a session lent a CUDA machine (docs/benchmarks.md):
#
#   bash benchmarks/gpu.sh [OUTDIR]        # default: $OUT, else /tmp/fusetune-gpu
#
# It needs only python3 with torch and pytest (the machine's own; not the project's venv):
# the CUDA tests, the out-of-memory split, the fusion benchmark at B up to 64, and what array
# sizing picks there.
set -uo pipefail
out=${1:-${OUT:-/tmp/fusetune-gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests/fusion${PYTHONPATH:+:$PYTHONPATH}"
members=${MEMBERS:-1,2,4,8,16,32,64}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c "import torch; print(torch.__version__)"; } \
  > "$out/gpu.txt" 2>&1
# --noconftest: the suite's conftest starts databases and Ray, which the CUDA tests do not use.
$py -m pytest --noconftest -p no:cacheprovider -q -rs tests/fusion/test_fusion_cuda.py 2>&1 | tee "$out/cuda_tests.txt"
# Out of memory: an array that runs out of CUDA memory is split and its halves train (issue 12).
$py -m pytest --noconftest -p no:cacheprovider -q -rs tests/workers/test_oom_cuda.py 2>&1 | tee "$out/oom_tests.txt"
$py benchmarks/fusion.py --device cuda --members "$members" --steps 10 --rounds 5 2>&1 | tee "$out/fusion_cuda.txt"
$py benchmarks/fusion.py --device cuda --sizing --members "$members" 2>&1 | tee "$out/sizing_cuda.txt"
