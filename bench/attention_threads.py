"""The CPU paged-attention kernel over a whole model's layers, at 1 and 2 threads.

    .venv/bin/python bench/attention_threads.py [--threads 1,2] [--layers 30]

Decode rows only, the default model's shape (9 query heads, 3 KV heads, head_dim 64, fp32,
blocks of 16 shuffled across each layer's pool). Every layer has its own pool, as in a model, so
the KV of all layers (``--layers`` x the batch's KV) does not stay in cache between calls: what a
decode step pays. Reports ms per layer (best of 5 passes over the layers) and the KV read per
second, the figure to hold against the machine's read bandwidth.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pdserve.kernels import cpu_ext  # noqa: E402
from pdserve.kernels.testing import query_start_loc, random_paged_kv  # noqa: E402

CASES = [(32, 256), (32, 1024), (8, 1024), (1, 4096)]  # (batch, context)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    assert cpu_ext.load() is not None, "the extension could not be built"
    print("| threads | batch x context | ms per layer | KV read GB/s |")
    print("|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for batch, ctx in CASES:
            layers = [random_paged_kv([ctx] * batch, 16, 3, 64, seed=i) for i in range(args.layers)]
            q, starts = torch.randn(batch, 9, 64), query_start_loc([1] * batch)

            def one_pass(layers=layers, q=q, starts=starts):
                for kv in layers:
                    cpu_ext.paged_attention(
                        q, kv.key_cache, kv.value_cache, kv.block_tables, starts, kv.context_lens, 0.125
                    )

            one_pass()
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                one_pass()
                best = min(best, (time.perf_counter() - start) / args.layers)
            kv_bytes = batch * ctx * 3 * 64 * 4 * 2
            print(
                f"| {threads} | {batch} x {ctx} | {best * 1e3:.3f} | {kv_bytes / best / 1e9:.1f} |",
                flush=True,
            )
            del layers


if __name__ == "__main__":
    main()
