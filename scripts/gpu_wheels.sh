#!/usr/bin/env bash
# Put the wheels the lent GPU machine lacks into .whl/, on the dev machine (GPU_PLAN.md 6.2).
#
# That machine has no network, so pip cannot fetch there; bench/gpu_oneshot.sh installs whatever
# .whl/ holds with `pip install --no-index`. The engine imports llguidance (engine/guided.py) and
# the nodes pyzmq; both ship abi3 wheels, so these fit its Python 3.12 whatever Python runs here.
# nvidia-ml-py (pure Python) lets an engine count its own CUDA context (engine/executor/platform.py).
# .whl/ is kept out of git (.gitignore): pass it to the device run in `carry`.
#
#     bash scripts/gpu_wheels.sh          # about 4 MB; PYTHON=... picks the pip that downloads
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pyzmq==27.3.0 llguidance==1.6.1
"$PY" -m pip download --no-deps --only-binary=:all: -d .whl nvidia-ml-py==12.575.51
ls -l .whl
