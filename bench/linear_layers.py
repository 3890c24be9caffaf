"""The default model's linear layers: torch's F.linear against oneDNN on a packed weight.

    .venv/bin/python bench/linear_layers.py [--threads 2] [--rows 1,8,32,256]

kernels/cpu_linear.py packs every nn.Linear's weight once at load time into oneDNN's blocked
layout (``mkldnn::_reorder_linear_weight``) and runs ``mkldnn::_linear_pointwise`` on it; F.linear
calls MKL's sgemm on the plain weight. Each figure is the best of 3 means of 50 calls, the two
paths alternating per shape, fp32, with the weights hot in cache (the model's 30 layers are not:
in a decode step the weights stream from memory, which these figures leave out).
"""

from __future__ import annotations

import argparse
import time

import torch

# (name, in, out) of SmolLM2-135M: hidden 576, 9 query / 3 KV heads of 64, intermediate 1536
SHAPES = [
    ("qkv", 576, 960),
    ("o", 576, 576),
    ("gate_up", 576, 3072),
    ("down", 1536, 576),
    ("lm_head", 576, 49152),
]


def best_ms(fn, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32,256")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| rows | layer | F.linear ms | oneDNN packed ms | speed-up | packed GFLOP/s |")
    print("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            for name, n_in, n_out in SHAPES:
                x, w = torch.randn(rows, n_in), torch.randn(n_out, n_in)
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                plain = best_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
                fast = best_ms(
                    lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                )
                gflops = 2 * rows * n_in * n_out / (fast / 1e3) / 1e9
                print(
                    f"| {rows} | {name} | {plain:.3f} | {fast:.3f} | {plain / fast:.2f}x | {gflops:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
