"""This CPU's matmul peaks on the paths the engine uses: fp32 and bf16 through oneDNN on packed
weights (kernels/cpu_linear.py), int8 through oneDNN's int8 matmul on prepacked int8 weights
with uint8 activations (kernels/cpu_int8.py, without the activations' quantization), each a
square matmul of ``--size`` at ``--threads`` threads, best of ``--rounds``. The engine's linear
layers' FLOP rates (bench/engine_profile.py) read as shares of these.

    .venv/bin/python bench/int8_peak.py [--size 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import pdserve.engine.llm  # noqa: E402,F401  (first: the engine's OpenMP default)
from pdserve.kernels import cpu_int8, cpu_linear  # noqa: E402


def best_seconds(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.size
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    flops = 2 * n**3
    rows = {}
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            if cpu_linear.enabled(dtype):
                packed, xd = cpu_linear.pack_weight(weight.to(dtype)), x.to(dtype)
                rows[str(dtype).removeprefix("torch.")] = best_seconds(
                    lambda p=packed, a=xd: cpu_linear.packed_matmul(a, p, None), args.rounds
                )
        if cpu_int8.available() is None:
            q = cpu_int8.pack_weight(weight)
            qx, _ = cpu_int8.quantize_rows(x)
            rows["int8"] = best_seconds(
                lambda: torch.ops.onednn.qlinear_pointwise(
                    qx, 1.0, cpu_int8.ZERO_POINT, q.packed, q.scale, q.zero_points,
                    None, 1.0, 0, torch.float32, "none", [], "",
                ),
                args.rounds,
            )  # fmt: skip
            rows["int8 with quantization"] = best_seconds(
                lambda: cpu_int8.int8_matmul(x, q, None), args.rounds
            )
    print(f"{n}^3 matmul, {args.threads} threads, best of {args.rounds}")
    print("| path | ms | GFLOP/s (GOP/s for int8) |")
    print("|---|---|---|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {flops / seconds / 1e9:.0f} |")


if __name__ == "__main__":
    main()
