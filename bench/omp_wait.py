"""Offline decode throughput on 2 cores, alone and beside one CPU-bound process, under
OpenMP wait settings; each setting runs in a fresh child process, rounds alternate.

    .venv/bin/python bench/omp_wait.py [--rounds 2] [--spincounts default,unset,passive] [--max-tokens 96]

A setting is ``default`` (what a user gets: neither variable set, so the engine's own spin count
of engine/machine/cpu_env.py, and the automatic thread count, which drops while another process loads the
CPUs: engine/machine/cpu_share.py), or 2 fixed threads under a GOMP_SPINCOUNT value, ``unset`` (libgomp's
default: GOMP_SPINCOUNT=300000, its documented spin count when OMP_WAIT_POLICY is unset) or
``passive`` (OMP_WAIT_POLICY=PASSIVE).

Why: OpenMP's worker threads spin while they wait; when another process holds one of two cores,
the spinning thread steals the time the working one needs.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys

CHILD = """
import os, random, sys, time
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_fetch import fetch_default_model
threads = os.environ.get("BENCH_THREADS")
llm = LLM(model=str(fetch_default_model(progress=False)), num_threads=int(threads) if threads else None)
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(8)]
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))
n = int(os.environ["BENCH_MAX_TOKENS"])
start = time.time()
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
print(8 * n / (time.time() - start))
"""


def run(spincount: str, busy: bool, max_tokens: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["BENCH_MAX_TOKENS"] = str(max_tokens)
    if spincount != "default":  # the others: 2 fixed threads under the given wait setting
        env["BENCH_THREADS"] = "2"
    if spincount == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    elif spincount != "default":
        env["GOMP_SPINCOUNT"] = "300000" if spincount == "unset" else spincount
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )
        return float(out.stdout.strip().splitlines()[-1])
    finally:
        if neighbour is not None:
            neighbour.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--spincounts", default="default,unset,passive")
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens of each of the 8 prompts")
    args = parser.parse_args()
    settings = [(s, busy) for s in args.spincounts.split(",") for busy in (False, True)]
    results: dict[tuple[str, bool], list[float]] = {k: [] for k in settings}
    for _ in range(args.rounds):
        for key in random.Random(len(results)).sample(settings, len(settings)):
            results[key].append(run(*key, args.max_tokens))
    for (spin, busy), values in results.items():
        print(
            f"GOMP_SPINCOUNT={spin:>6}  {'busy neighbour' if busy else 'quiet         '}  "
            f"{' '.join(f'{v:6.1f}' for v in values)} tok/s"
        )


if __name__ == "__main__":
    main()
