"""Decode step time against the memory-bandwidth floor, and a profile of one decode step.

    .venv/bin/python bench/decode_floor.py floor [--batches 1,8,32] [--contexts 256,1024,4096]
    .venv/bin/python bench/decode_floor.py profile --batch 32 --context 1024
    .venv/bin/python bench/decode_floor.py prefill --prompts 256x8     # one prefill step, profiled

A decode step must read every weight once and each sequence's whole KV context once, so

    floor = (weight bytes + KV bytes read) / copy bandwidth

with the bandwidth measured here, now, as torch ``copy_`` of a 1 GiB buffer with the same threads
(bytes copied per second; numpy's single-threaded figure beside it). The step is the model
runner's ``execute`` on a synthetic batch (the default model unless --model; every sequence at the
given context, its blocks shuffled across the pool, the cache filled with random values), best of
--repeats. ``profile`` runs the torch profiler over one such step and splits its wall time into
matmul, attention (the paged-attention op, or the torch path's gather + SDPA + masks, and the KV
write) and everything else, host-side Python included (wall time minus the ops' own time).
Set PDSERVE_REPO to profile another checkout with this script (its ModelRunner API must match).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import sys
import time

REPO = pathlib.Path(os.environ.get("PDSERVE_REPO") or pathlib.Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(REPO))

import pdserve.engine.llm  # noqa: E402,F401 - first: the engine's OpenMP default applies as in a user's process

# isort: split
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdserve.engine import SamplingParams  # noqa: E402
from pdserve.engine.config import EngineConfig, ModelConfig  # noqa: E402
from pdserve.engine.core.scheduler import ScheduledSeq, SchedulerOutput  # noqa: E402
from pdserve.engine.core.sequence import Sequence  # noqa: E402
from pdserve.engine.executor.model_runner import ModelRunner  # noqa: E402
from pdserve.protocol.kv_layout import KVCacheSpec  # noqa: E402

BLOCK_SIZE = 16
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise"}
ATTENTION_OPS = {
    "pdserve_cpu::paged_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_attention_math",
    "aten::index_select",  # the torch path's gather of K/V blocks
    "aten::index_copy_",  # the KV write of every path
    "aten::masked_fill_",  # the torch path's masks
}


def model_path(arg: str) -> pathlib.Path:
    if arg == "default":
        from pdserve.engine.model_fetch import fetch_default_model

        return fetch_default_model(progress=False)
    return pathlib.Path(arg)


def _runner(path: pathlib.Path, num_blocks: int, max_len: int, dtype: str) -> tuple[ModelConfig, ModelRunner]:
    cfg = ModelConfig.from_path(path)
    spec = KVCacheSpec(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype)
    config = EngineConfig(
        model=str(path),
        dtype=dtype,
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        max_model_len=max_len,
    )
    return cfg, ModelRunner(cfg, config, spec)


def decode_batch(
    path: pathlib.Path, batch: int, context: int, dtype: str = "float32"
) -> tuple[ModelRunner, SchedulerOutput]:
    """A runner whose cache holds ``batch`` sequences of ``context - 1`` tokens, each due one more."""
    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    cfg, runner = _runner(path, num_blocks, context, dtype)
    for key_cache, value_cache in runner.kv_caches:
        key_cache.normal_()
        value_cache.normal_()
    rng = random.Random(0)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    items = []
    for i in range(batch):
        tokens = [rng.randrange(100, cfg.vocab_size) for _ in range(context)]
        seq = Sequence(f"s{i}", tokens, context - 1, SamplingParams(temperature=0.0))
        seq.block_table = blocks[i * per_seq : (i + 1) * per_seq]
        seq.num_computed_tokens = context - 1
        items.append(ScheduledSeq(seq, 1))
    return runner, SchedulerOutput(items, [], [])


def prefill_batch(
    path: pathlib.Path, lens: list[int], dtype: str = "float32"
) -> tuple[ModelRunner, SchedulerOutput]:
    """A runner with one step that prefills fresh prompts of ``lens`` tokens, blocks shuffled."""
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 1
    cfg, runner = _runner(path, num_blocks, max(lens), dtype)
    rng = random.Random(0)
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    items, used = [], 0
    for i, n in enumerate(lens):
        seq = Sequence(f"p{i}", [rng.randrange(100, cfg.vocab_size) for _ in range(n)], n, SamplingParams())
        k = -(-n // BLOCK_SIZE)
        seq.block_table, used = blocks[used : used + k], used + k
        items.append(ScheduledSeq(seq, n))
    return runner, SchedulerOutput(items, [], [])


def step_seconds(runner: ModelRunner, sched: SchedulerOutput, repeats: int) -> float:
    runner.execute(sched)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(sched)
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth() -> tuple[float, float]:
    """Bytes copied per second: torch copy_ (torch's threads) and numpy copyto (one thread), 1 GiB."""
    src, dst = torch.ones(1 << 28), torch.empty(1 << 28)
    dst.copy_(src)
    best_torch = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    a, b = src.numpy(), dst.numpy()
    best_np = min(_timed(lambda: np.copyto(b, a)) for _ in range(3))
    return (1 << 30) / best_torch, (1 << 30) / best_np


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def floor_table(args) -> None:
    path = model_path(args.model)
    cfg = ModelConfig.from_path(path)
    kv_token_bytes = (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (4 if args.dtype == "float32" else 2)
    )
    bandwidth, bandwidth_np = copy_bandwidth()
    print(
        f"copy bandwidth: torch copy_ {bandwidth / 1e9:.1f} GB/s, numpy copyto {bandwidth_np / 1e9:.1f} GB/s"
    )
    print("| batch | context | step ms | floor ms | step / floor | weights MB | KV read MB |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(x) for x in args.batches.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            runner, sched = decode_batch(path, batch, context, args.dtype)
            weight_bytes = runner.weight_bytes
            kv_bytes = batch * context * kv_token_bytes
            step = step_seconds(runner, sched, args.repeats)
            floor = (weight_bytes + kv_bytes) / bandwidth
            print(
                f"| {batch} | {context} | {step * 1e3:.1f} | {floor * 1e3:.1f} | {step / floor:.2f}x | "
                f"{weight_bytes / 1e6:.0f} | {kv_bytes / 1e6:.0f} |",
                flush=True,
            )
            del runner


def profile_step(args) -> None:
    if args.command == "prefill":
        count, _, times = args.prompts.partition("x")
        runner, sched = prefill_batch(model_path(args.model), [int(count)] * int(times or 1), args.dtype)
        label = f"prefill step, {times or 1} prompts of {count} tokens"
    else:
        runner, sched = decode_batch(model_path(args.model), args.batch, args.context, args.dtype)
        label = f"decode step, batch {args.batch}, context {args.context}"
    print(f"{label}: {step_seconds(runner, sched, 3) * 1e3:.1f} ms (best of 3, not profiled)")
    for _ in range(2):  # the profiler's first session pays its own start-up: the second counts
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(args.steps):
                runner.execute(sched)
            wall = (time.perf_counter() - start) / args.steps
    events = prof.key_averages()
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / 1e6 / args.steps
    attention = sum(e.self_cpu_time_total for e in events if e.key in ATTENTION_OPS) / 1e6 / args.steps
    print(f"{label}: {wall * 1e3:.1f} ms (profiled, mean of {args.steps})")
    print(f"  matmul    {matmul * 1e3:7.1f} ms  {matmul / wall:6.1%}")
    print(f"  attention {attention * 1e3:7.1f} ms  {attention / wall:6.1%}")
    other = wall - matmul - attention
    print(f"  other     {other * 1e3:7.1f} ms  {other / wall:6.1%}  (other ops and host-side Python)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    floor = sub.add_parser("floor")
    floor.add_argument("--batches", default="1,8,32")
    floor.add_argument("--contexts", default="256,1024,4096")
    floor.add_argument("--repeats", type=int, default=5)
    prof = sub.add_parser("profile")
    prof.add_argument("--batch", type=int, default=32)
    prof.add_argument("--context", type=int, default=1024)
    prof.add_argument("--rows", type=int, default=12)
    prof.add_argument("--steps", type=int, default=3)
    pre = sub.add_parser("prefill")
    pre.add_argument("--prompts", default="256x8", help="LENxCOUNT fresh prompts in one step")
    pre.add_argument("--rows", type=int, default=12)
    pre.add_argument("--steps", type=int, default=1)
    for p in (floor, prof, pre):
        p.add_argument("--model", default="default", help="'default' or a model folder")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    floor_table(args) if args.command == "floor" else profile_step(args)


if __name__ == "__main__":
    main()
