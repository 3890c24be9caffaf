#!/usr/bin/env bash
# The one-shot check for a lent GPU machine that has the repository copied and no network at all
# (GPU_PLAN.md 6.2). In order, each step under its own time limit:
#
#   wheels   pyzmq and llguidance from .whl/ (scripts/gpu_wheels.sh) into a private folder
#   env      nvidia-smi, versions and ceilings: copy, pinned/pageable H2D and D2H, bf16 matmul
#   kernels  the Triton kernel tests (tests/test_kernels_triton.py, tests/test_kernels_gpu.py)
#   hd256    the prefill kernel in bf16 at head_dim 256 and its default tiles (shared memory)
#   lora     the LoRA kernels (tests/test_lora_kernels.py)
#   decode   bench/gpu_decode_bench.py: paged decode attention against the copy bandwidth
#   probe    does the engine generate on CUDA (a seeded tiny model from tests/tiny_models.py)?
#   nccl     the same over an NCCL group of one (its own row: its failure skips nothing else)
#   engine   tests/test_engine_gpu.py, when the probe passed
#   paths    bench/gpu_paths.py: beam search and speculation on CUDA against the CPU engine
#   transfer tests/test_transfer_gpu.py: a prefill and a decode node on one GPU, device KV between them
#   offline  bench/gpu_offline.py: a random ~1B Llama in bf16, pdserve against HF generate
#
# then the summary table (bench/gpu_oneshot_summary.py), also saved as summary.txt. Logs go to
# $OUT (a new temporary folder when unset): 6 logs and the summary, as at most 8 files come back
# (hd256 and lora log into kernels.log, nccl into probe.log, paths and transfer into engine.log)
# from the machine. It never contacts a package index and never collects the whole tests/ tree
# (most test modules import pyzmq, fastapi or redis, which the machine lacks).
#
#     bash bench/gpu_oneshot.sh            # PYTHON=... to choose the interpreter
#     bash bench/gpu_oneshot.sh --dry-run  # on the dev machine's CPU: every row, nothing measured
#
# Exit 0 when every step that ran passed, 1 when one did not, 3 when torch sees no CUDA device.
set -uo pipefail

# Time limits in seconds, one per row. Together at most 535: timeout(1) may add 3 s of grace to
# each of the 13, and the summary takes under 5, so even a run where every step hits its limit ends
# by 579 s, inside the 600 s a device command may run (a typical run is about half of it). That
# leaves no rerun inside a task's 15 minutes when every step times out; a typical run does. The
# probe and the engine tests pay the Triton compiles, cold on a fresh machine (30-45 kernels); the
# later steps find them cached. The offline step's work, estimated (not yet measured on a GPU):
# building and saving the ~1B model ~10 s; HF generate at batches 32, 64 and 128 with a warm-up
# each, 640 + 384 + 256 steps at ~20 ms = ~26 s; pdserve's start (load, profile, graphs) ~25 s and
# its 128 x 128 tokens ~5 s: ~66 s, and 85 s leaves it a quarter more.
LIMIT_CHECK=10
LIMIT_WHEELS=10
LIMIT_ENV=20
LIMIT_KERNELS=65
LIMIT_HD256=30
LIMIT_LORA=30
LIMIT_DECODE=40
LIMIT_PROBE=50
LIMIT_NCCL=25
LIMIT_ENGINE=90
LIMIT_PATHS=35
LIMIT_TRANSFER=45
LIMIT_OFFLINE=85
GRACE=3  # seconds a step may run past its limit before it is killed (-k)

# --dry-run: the same steps on this CPU, where each can run at all (kernels in Triton's
# interpreter, the probe on the split platform that stands in for a GPU, the offline bench's
# smoke run); the GPU-only steps leave a skip row. It checks the plumbing and the code paths
# before a GPU is lent; it measures nothing.
DRY_RUN=0
case "$*" in
"") ;;
--dry-run) DRY_RUN=1 ;;
*)
    echo "usage: bash bench/gpu_oneshot.sh [--dry-run] (the output folder is \$OUT)" >&2
    exit 2
    ;;
esac
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-oneshot.XXXXXX")}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: the script moves to the checkout
cd "$(dirname "$0")/.."

# python3 is the machine's CUDA torch. A .venv counts only if its torch is a CUDA build: the dev
# machine's has the pinned CPU wheel, which would see no GPU.
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] &&
    .venv/bin/python -c 'import sys, torch; sys.exit(torch.version.cuda is None)' 2>/dev/null; then
    PY=.venv/bin/python
fi
if [ "$DRY_RUN" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python  # the dev machine's, with the CPU torch
fi
seen="$(timeout "$LIMIT_CHECK" "$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' 2>&1 | tail -1)"
if [ "$DRY_RUN" = 0 ] && [[ "$seen" != *" True" ]]; then
    gpus="$(nvidia-smi -L 2>/dev/null | head -1)"
    echo "gpu_oneshot: torch in $PY sees no CUDA device (torch: ${seen:-nothing printed});" \
        "nvidia-smi: ${gpus:-no GPU listed}. Nothing was run." >&2
    exit 3
fi

# The repository is copied, not installed: the checkout first on the path, then the carried wheels.
WHEELS="${TMPDIR:-/tmp}/pdserve-wheels"
export PYTHONPATH="$PWD:$WHEELS${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1  # nothing may reach a network
for name in env kernels decode probe engine offline; do rm -f "$OUT/$name.log"; done
rm -f "$OUT/summary.txt"
echo "gpu_oneshot: $PY (torch $seen), logs in $OUT"

log_of() {  # steps share logs, to keep under the 8 files that come back
    case "$1" in
    wheels) echo "$OUT/env.log" ;;
    hd256 | lora) echo "$OUT/kernels.log" ;;
    nccl) echo "$OUT/probe.log" ;;
    paths | transfer) echo "$OUT/engine.log" ;;
    *) echo "$OUT/$1.log" ;;
    esac
}

step() {  # step NAME LIMIT COMMAND...: COMMAND under timeout(1), its output and exit status in the log
    local name=$1 limit=$2 log start rc command
    shift 2
    log="$(log_of "$name")"
    start=$SECONDS
    command="$*"
    echo "== step $name (limit $limit s): ${command//$'\n'/ }" | tee -a "$log"  # one line: the summary reads it
    timeout -k "$GRACE" "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "== exit $name $rc ($((SECONDS - start)) s)" | tee -a "$log"
    return "$rc"
}

skip() {  # skip NAME REASON
    echo "== skip $1: $2" | tee -a "$(log_of "$1")"
}

# What the machine lacks and the engine imports: pyzmq (the nodes) and llguidance (guided decoding).
missing=""
for wheel in pyzmq llguidance; do
    compgen -G ".whl/$wheel-*.whl" >/dev/null || missing="$missing $wheel"
done
if [ -n "$missing" ]; then
    skip wheels "no wheel of${missing} in .whl/: run \`bash scripts/gpu_wheels.sh\` where pip reaches PyPI and carry .whl/ (the engine needs both)"
elif [ "$DRY_RUN" = 1 ]; then
    skip wheels "dry run: .whl/ holds$(printf ' %s' .whl/*.whl | sed 's|.whl/||g'), for the GPU machine's Python 3.12"
elif "$PY" -m pip --version >/dev/null 2>&1; then
    step wheels "$LIMIT_WHEELS" "$PY" -m pip install --no-index --no-deps --disable-pip-version-check \
        --upgrade --target "$WHEELS" .whl/*.whl
else
    # A venv made without pip (uv makes them so): these two wheels have no .data folder, so
    # unpacking each is exactly what pip --target would install.
    step wheels "$LIMIT_WHEELS" bash -c 'set -e; py=$1 dir=$2; shift 2
        for w in "$@"; do "$py" -m zipfile -e "$w" "$dir"; done; echo "Successfully installed (unpacked) ${*##*/}"' \
        _ "$PY" "$WHEELS" .whl/*.whl
fi

if [ "$DRY_RUN" = 1 ]; then
    skip env "dry run: no GPU to measure (torch $seen)"
else
step env "$LIMIT_ENV" "$PY" - <<'EOF'
import shutil, subprocess
import torch, triton
from bench import gpu_decode_bench as decode_bench

if shutil.which("nvidia-smi"):
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    print("nvidia-smi:", subprocess.run(query, capture_output=True, text=True, timeout=15).stdout.strip())
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"device {torch.cuda.get_device_name()}")


def median_ms(fn):  # CUDA events around each of 10 runs, after one warm-up (the decode bench's)
    return decode_bench.median_ms(fn, warmup=1, iters=10)


n = 1 << 30  # well past the 60 MB L2
src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
print(f"copy d2d: {2 * n / median_ms(lambda: dst.copy_(src)) / 1e6:.0f} GB/s (read + write of 1 GiB)")
m = 256 << 20
dev = torch.empty(m, dtype=torch.uint8, device="cuda")
for kind, pinned in (("pinned", True), ("pageable", False)):
    host = torch.ones(m, dtype=torch.uint8, pin_memory=pinned)  # pages touched before timing
    print(f"h2d {kind}: {m / median_ms(lambda: dev.copy_(host, non_blocking=pinned)) / 1e6:.1f} GB/s (256 MiB)")
    print(f"d2h {kind}: {m / median_ms(lambda: host.copy_(dev, non_blocking=pinned)) / 1e6:.1f} GB/s (256 MiB)")
k = 8192
a, b = torch.randn(k, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
print(f"matmul bf16 {k}^3: {2 * k**3 / median_ms(lambda: a @ b) / 1e9:.0f} TFLOP/s")
EOF
fi

# Only these modules: they import torch, triton and kernels, nothing the machine lacks.
if [ "$DRY_RUN" = 1 ]; then
    step kernels "$LIMIT_KERNELS" env TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_kernels_triton.py tests/test_kernels_gpu.py
    skip hd256 "dry run: the interpreter computes bf16 dots wrongly; the point is the compile"
    skip lora "dry run: tests/test_lora_kernels.py runs interpreted in the CPU suite"
    skip decode "dry run: the decode bandwidth needs a GPU"
else
    step kernels "$LIMIT_KERNELS" "$PY" -m pytest -q -p no:cacheprovider -n 8 \
        tests/test_kernels_triton.py tests/test_kernels_gpu.py -k "not head_dim_256"
    step hd256 "$LIMIT_HD256" "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_triton.py -k head_dim_256
    step lora "$LIMIT_LORA" "$PY" -m pytest -q -p no:cacheprovider tests/test_lora_kernels.py
    step decode "$LIMIT_DECODE" "$PY" bench/gpu_decode_bench.py
fi

probe_ok=0
if [ "$DRY_RUN" = 1 ]; then
    step probe "$LIMIT_PROBE" env PDSERVE_TEST_PLATFORM=split "$PY" bench/gpu_probe.py --device cpu && probe_ok=1
    step nccl "$LIMIT_NCCL" env PDSERVE_TEST_PLATFORM=split "$PY" bench/gpu_probe.py --device cpu --group-of-one
else
    step probe "$LIMIT_PROBE" "$PY" bench/gpu_probe.py && probe_ok=1
    step nccl "$LIMIT_NCCL" "$PY" bench/gpu_probe.py --group-of-one
fi

if [ "$DRY_RUN" = 1 ]; then
    skip engine "dry run: the engine GPU tests need a GPU"
    step paths "$LIMIT_PATHS" env PDSERVE_TEST_PLATFORM=split "$PY" bench/gpu_paths.py --device cpu
    skip transfer "dry run: the split platform's pair runs in tests/test_platform.py"
    step offline "$LIMIT_OFFLINE" "$PY" bench/gpu_offline.py --smoke
elif [ "$probe_ok" = 1 ]; then
    step engine "$LIMIT_ENGINE" "$PY" -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py
    step paths "$LIMIT_PATHS" "$PY" bench/gpu_paths.py
    step transfer "$LIMIT_TRANSFER" "$PY" -m pytest -q -p no:cacheprovider tests/test_transfer_gpu.py
    step offline "$LIMIT_OFFLINE" "$PY" bench/gpu_offline.py
else
    skip engine "the engine probe failed"
    skip paths "the engine probe failed"
    skip transfer "the engine probe failed"
    step offline "$LIMIT_OFFLINE" "$PY" bench/gpu_offline.py --skip-pdserve  # HF's baseline still
fi

echo
"$PY" bench/gpu_oneshot_summary.py "$OUT" | tee "$OUT/summary.txt"
exit "${PIPESTATUS[0]}"
