#!/usr/bin/env bash
# GPU readiness check for kernels/: GPU-marked tests, the Triton kernel tests compiled for
# CUDA, then the paged-decode bandwidth table. Needs a CUDA build of torch and an NVIDIA GPU;
# finishes in well under 8 minutes (each step has its own time limit).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1)); nothing to check."
    exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

status=0
echo "== GPU-marked tests"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests || status=1
echo "== Triton kernels vs references (compiled)"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py || status=1
echo "== paged decode attention bandwidth"
timeout 150 "$PY" bench/gpu_decode_bench.py "$@" || status=1
exit "$status"
