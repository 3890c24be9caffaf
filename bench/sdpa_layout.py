"""CPU SDPA on 3-D [H, T, D] against 4-D [1, H, T, D] inputs, causal, side by side in one run.

The engine's CPU prefill attention used 3-D inputs until 2026-12-01, which torch runs on its unfused
math path; 4-D inputs take the fused flash kernel. Prints the median seconds of each and the ratio.

    .venv/bin/python bench/sdpa_layout.py [--tokens 1500] [--heads 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _time(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rounds: int) -> float:
    F.scaled_dot_product_attention(q, k, v, is_causal=True)  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--heads", type=int, default=9)  # the default model's query heads
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    q, k, v = (torch.randn(args.heads, args.tokens, args.head_dim) for _ in range(3))
    results = {}
    for _ in range(2):  # alternate, so a noisy neighbour hits both
        results.setdefault("3-D", []).append(_time(q, k, v, args.rounds))
        results.setdefault("4-D", []).append(_time(q[None], k[None], v[None], args.rounds))
    three, four = min(results["3-D"]), min(results["4-D"])
    print(
        f"{args.tokens} tokens x {args.heads} heads, {args.threads} thread(s): 3-D {three * 1000:.1f} ms, "
        f"4-D {four * 1000:.1f} ms, 4-D is {three / four:.2f}x faster"
    )


if __name__ == "__main__":
    main()
