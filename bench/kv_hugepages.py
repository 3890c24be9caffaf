"""Decode step times with the KV pool on transparent huge pages or on 4 KB pages (issue 33, item 3).

    .venv/bin/python bench/kv_hugepages.py --rounds 3

A node's private KV pool is numpy's zeros (engine/executor/model_runner.py), and numpy asks the kernel for
huge pages on every large allocation (madvise MADV_HUGEPAGE, its default on Linux); the prefill
node's shared-memory pool gets none. Whether a huge page is there when a block is first written
depends on how fragmented memory is at that moment, which could move step times from one run to
the next. Each round runs two child processes one after the other, numpy's huge-page advice on
and off. Each child: the default model, one thread, 16 prompts of 512 random tokens prefilled,
then 48 decode steps timed one by one; it reports the median and p90 step and how much of its
memory the kernel backed with huge pages.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def anon_huge_mb() -> float:
    for line in pathlib.Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def child(hugepages: bool, batch: int, context: int, steps: int) -> dict:
    import numpy as np

    np._core.multiarray._set_madvise_hugepage(hugepages)
    import pdserve.engine.llm  # noqa: F401 - the engine's OpenMP default, before torch loads
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.model_fetch import fetch_default_model

    llm = LLM(str(fetch_default_model(progress=False)), num_threads=1, max_num_seqs=batch, kv_commit="lazy")
    eng, rng = llm.engine, random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        eng.add_request(
            str(i), prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        )
    sched = eng.scheduler
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        eng.step()
    eng.step()  # the first all-decode step pays for its shapes
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return {
        "hugepages": hugepages,
        "median_ms": round(1e3 * statistics.median(times), 2),
        "p90_ms": round(1e3 * times[int(0.9 * len(times))], 2),
        "anon_huge_mb": round(anon_huge_mb()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "on", args.batch, args.context, args.steps)), flush=True)
        return
    rows = []
    for k in range(args.rounds):
        for setting in ("on", "off"):
            cmd = [sys.executable, __file__, "--child", setting, "--batch", str(args.batch)]
            cmd += ["--context", str(args.context), "--steps", str(args.steps)]
            out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
            row = {"round": k + 1, **json.loads(out.strip().splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| round | huge pages advised | decode step median ms | p90 ms | AnonHugePages MB |")
    print("|---|---|---|---|---|")
    for r in rows:
        on = "on" if r["hugepages"] else "off"
        print(f"| {r['round']} | {on} | {r['median_ms']} | {r['p90_ms']} | {r['anon_huge_mb']} |")


if __name__ == "__main__":
    main()
