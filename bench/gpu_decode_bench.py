"""Time Triton paged decode attention on a CUDA GPU against the device's copy bandwidth.

For batch x context in {1, 32, 256} x {512, 4k, 32k} (combinations that do not fit in free
memory are skipped), prints the median time (CUDA events, after warm-up) and the achieved
bandwidth: K+V bytes read / time, next to a measured device-to-device copy's
(bytes read + written) / time. Decode attention is bandwidth-bound, so the ratio is its
efficiency. Shapes default to a Llama-3-8B layer: 32 query heads, 8 KV heads, head_dim 128.

    python bench/gpu_decode_bench.py [--dtype bfloat16] [--block-size 16] [--iters 20]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the checkout's kernels


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(num_bytes: int, warmup: int, iters: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup, iters)
    return 2 * num_bytes / ms / 1e6  # read + write


def bench_decode(batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype) -> tuple[float, int]:
    from pdserve.kernels.ops import paged_decode_attention

    blocks_per_seq = -(-context // args.block_size)
    cache_shape = (batch * blocks_per_seq, args.block_size, args.kv_heads, args.head_dim)
    key_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
    value_cache = torch.randn(cache_shape, device="cuda", dtype=dtype)
    # scattered block tables: a random permutation of the pool
    perm = torch.randperm(batch * blocks_per_seq, device="cuda", dtype=torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, args.heads, args.head_dim, device="cuda", dtype=dtype)
    scale = args.head_dim**-0.5

    def run() -> None:
        paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)

    ms = median_ms(run, args.warmup, args.iters)
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * key_cache.element_size()
    return ms, kv_bytes


def fits(batch: int, context: int, args: argparse.Namespace, dtype: torch.dtype) -> bool:
    element = torch.empty((), dtype=dtype).element_size()
    kv_bytes = (
        2 * batch * -(-context // args.block_size) * args.block_size * args.kv_heads * args.head_dim * element
    )
    free, _ = torch.cuda.mem_get_info()
    return kv_bytes < 0.8 * free


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode_bench: no CUDA device (torch.cuda.is_available() is False); nothing to time.")
        return 0
    dtype = getattr(torch, args.dtype)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    copy_gbs = copy_bandwidth_gbs(1 << 30, args.warmup, args.iters)
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write of 1 GiB)")
    print(f"decode: {args.dtype}, heads {args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, "
          f"block_size {args.block_size}")  # fmt: skip
    print(f"{'batch':>6} {'context':>8} {'KV MiB':>9} {'ms':>9} {'GB/s':>8} {'% copy':>7}")
    for batch in args.batches:
        for context in args.contexts:
            if not fits(batch, context, args, dtype):
                print(f"{batch:>6} {context:>8}  skipped: KV does not fit in free memory")
                continue
            ms, kv_bytes = bench_decode(batch, context, args, dtype)
            gbs = kv_bytes / ms / 1e6
            print(
                f"{batch:>6} {context:>8} {kv_bytes / 2**20:>9.0f} {ms:>9.3f} {gbs:>8.0f} {100 * gbs / copy_gbs:>6.0f}%"
            )
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
