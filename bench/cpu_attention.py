"""The C++ CPU paged-attention kernel against the torch path, side by side, on one thread.

    .venv/bin/python bench/cpu_attention.py [--rounds 7] [--dtype bfloat16]
    .venv/bin/python bench/cpu_attention.py --int8 [--threads 2]     # fp32 cache against int8 rows

The default model's attention shape (9 query heads, 3 KV heads, head_dim 64, fp32 unless --dtype, blocks of 16
shuffled across the pool). Rounds alternate the two paths; each figure is the median over rounds
of the CPU time the call used (``time.process_time``: on a shared machine, time spent descheduled
does not count, which wall time would). One thread, so the call's CPU time is its cost.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import statistics
import sys
import time

# PDSERVE_REPO: measure another checkout's kernel with this script (before / after a change).
sys.path.insert(0, os.environ.get("PDSERVE_REPO") or str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pdserve.kernels import cpu_ext, kv_int8, torch_fast  # noqa: E402
from pdserve.kernels.testing import query_start_loc, random_paged_kv  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DECODES = [(1, 256), (1, 4096), (8, 1024), (32, 256), (32, 1024)]  # (batch, context)
# --int8: a decode step's attention over all the default model's 30 layers, each with its own cache,
# so that every call reads its K/V from DRAM as a real step does (one layer's cache alone would sit
# in L3 and flatter the wider fp32 rows)
INT8_DECODES = [(1, 4096), (4, 4096), (16, 1024), (32, 256)]
INT8_LAYERS = 30
PREFILLS = [([512], [512]), ([128] * 4, [128] * 4), ([64, 64], [1024, 600])]  # (query lens, context lens)


def cpu_ms(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def compare(name: str, native, torch_path, rounds: int) -> None:
    native(), torch_path()  # warm-up
    a, b = [], []
    for _ in range(rounds):  # alternate, so both see the same machine
        a.append(cpu_ms(native, 1))
        b.append(cpu_ms(torch_path, 1))
    ours, theirs = statistics.median(a), statistics.median(b)
    print(f"| {name} | {ours:.2f} | {theirs:.2f} | {theirs / ours:.2f}x |", flush=True)


def int8_cache(rounds: int) -> None:
    """The C++ kernel over an fp32 cache and over the same values as int8 rows, layer by layer."""
    print(f"| decode step, {INT8_LAYERS} layers | fp32 cache ms | int8 cache ms | speed-up | max abs diff |")
    print("|---|---|---|---|---|")
    for batch, context in INT8_DECODES:
        layers = []
        for layer in range(INT8_LAYERS):
            kv = random_paged_kv([context] * batch, BLOCK, KV_HEADS, HEAD_DIM, seed=layer)
            q8 = (kv_int8.quantize_rows(kv.key_cache), kv_int8.quantize_rows(kv.value_cache))
            layers.append((kv, q8))
        q = torch.randn(batch, HEADS, HEAD_DIM)
        qsl = query_start_loc([1] * batch)

        def step(int8: bool, layers=layers, q=q, qsl=qsl) -> torch.Tensor:
            for kv, q8 in layers:
                k, v = q8 if int8 else (kv.key_cache, kv.value_cache)
                out = cpu_ext.paged_attention(q, k, v, kv.block_tables, qsl, kv.context_lens, 0.125)
            return out

        diff = (step(True) - step(False)).abs().max().item()
        name = f"batch {batch} x context {context}"
        a, b = [], []
        for _ in range(rounds):  # alternate, so both see the same machine
            a.append(cpu_ms(functools.partial(step, False), 1))
            b.append(cpu_ms(functools.partial(step, True), 1))
        fp32, int8 = statistics.median(a), statistics.median(b)
        print(f"| {name} | {fp32:.2f} | {int8:.2f} | {fp32 / int8:.2f}x | {diff:.1e} |", flush=True)
        del layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="query and cache")
    ap.add_argument("--int8", action="store_true", help="fp32 cache against int8 rows (C++ kernel both)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU time then sums them)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    assert cpu_ext.load() is not None, "the extension did not build"
    if args.int8:
        return int8_cache(args.rounds)
    print("| case | C++ kernel ms | torch path ms | speed-up |")
    print("|---|---|---|---|")
    for batch, context in DECODES:
        kv = random_paged_kv([context] * batch, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, seed=1)
        q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
        qsl = query_start_loc([1] * batch)
        caches = (kv.key_cache, kv.value_cache, kv.block_tables)
        compare(
            f"decode, batch {batch} x context {context}",
            functools.partial(cpu_ext.paged_attention, q, *caches, qsl, kv.context_lens, 0.125),
            functools.partial(torch_fast.paged_decode_attention, q, *caches, kv.context_lens, 0.125),
            args.rounds,
        )
    for query_lens, context_lens in PREFILLS:
        kv = random_paged_kv(context_lens, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, seed=1)
        q = torch.randn(sum(query_lens), HEADS, HEAD_DIM).to(dtype)
        args_ = (
            q,
            kv.key_cache,
            kv.value_cache,
            kv.block_tables,
            query_start_loc(query_lens),
            kv.context_lens,
            0.125,
        )
        compare(
            f"prefill, queries {query_lens} over contexts {context_lens}",
            functools.partial(cpu_ext.paged_attention, *args_),
            functools.partial(torch_fast.paged_prefill_attention, *args_),
            args.rounds,
        )


if __name__ == "__main__":
    main()
