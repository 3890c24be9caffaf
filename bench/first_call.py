"""A fresh offline engine's first ``generate`` against a warm one, on the default model.

Each round starts a new process with a new ``LLM`` (its defaults, as a user gets them: the KV
pool sized from free memory, ``--dtype auto``) and times two calls on two workloads of the same
shape but different prompts (no prefix hits between them): the first call is the fresh engine's,
the second a warm one's. Rounds alternate which workload comes first, so each workload is timed
both cold and warm. ``--grow-first`` runs the block manager as it was before reuse-first
allocation (never-used blocks first, whatever their memory; engine/core/block_manager.py).

    .venv/bin/python bench/first_call.py --rounds 2
    .venv/bin/python bench/first_call.py --rounds 2 --grow-first
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
from pdserve.engine import LLM, SamplingParams  # first: the engine's OpenMP default applies
from bench.offline_throughput import workload
spec = json.loads(sys.argv[1])
start = time.perf_counter()
llm = LLM(spec["model"], **spec["engine"])
built = time.perf_counter() - start
engine = llm.engine
if spec["grow_first"]:
    engine.kv_prefault.fresh_limit = lambda: engine.kv_spec.num_blocks
vocab = engine.model_config.vocab_size
loads = [workload(spec["workload"], spec["num_prompts"], vocab, seed=s) for s in spec["seeds"]]
calls = []
for reqs in loads:
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    seconds = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    calls.append({"seconds": seconds, "tok_s": tokens / seconds})
print(json.dumps({
    "construct_s": built, "calls": calls, "dtype": engine.config.dtype,
    "pool_mib": engine.kv_spec.num_blocks * engine.kv_spec.bytes_per_block / 2**20,
    "high_water": engine.block_manager.high_water, "num_blocks": engine.kv_spec.num_blocks,
    "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--workload", default="mix32")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--grow-first", action="store_true")
    ap.add_argument("--engine", default="{}", help="extra LLM arguments as JSON")
    args = ap.parse_args()
    model = args.model
    if model == "default":
        from pdserve.engine.model_fetch import fetch_default_model

        model = str(fetch_default_model())
    for r in range(args.rounds):
        seeds = [0, 1] if r % 2 == 0 else [1, 0]
        spec = {
            "model": model,
            "engine": json.loads(args.engine),
            "grow_first": args.grow_first,
            "workload": args.workload,
            "num_prompts": args.num_prompts,
            "seeds": seeds,
        }
        out = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(spec)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise SystemExit(f"round {r} failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        first, warm = result["calls"]
        print(
            f"round {r} (seeds {seeds}, {result['dtype']}, pool {result['pool_mib']:.0f} MiB): "
            f"construct {result['construct_s']:.1f} s; first call {first['seconds']:.1f} s "
            f"({first['tok_s']:.1f} tok/s), warm call {warm['seconds']:.1f} s ({warm['tok_s']:.1f} tok/s), "
            f"first/warm time {first['seconds'] / warm['seconds']:.2f}; blocks ever used "
            f"{result['high_water']} of {result['num_blocks']}; max RSS {result['max_rss_mib']:.0f} MiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
