"""pdserve's offline pass under cProfile: how much of it is Python outside the torch ops.

    .venv/bin/python bench/python_overhead.py [--top 35]

The default model with the ``LLM`` defaults (prefix caching off, so that the profiled pass, on
prompts of its own, computes them all), one warm-up pass of the mix32 workload (48 prompts), then
a pass on other prompts of the same shape under cProfile, its functions by own time. The torch
ops show as built-in methods; what is left of the wall time is the Python around them.
"""

from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pdserve.engine.llm  # noqa: E402,F401 - before torch: the engine's OpenMP default applies

# isort: split
from bench.offline_throughput import workload  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.model_fetch import fetch_default_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    llm = LLM(str(fetch_default_model(progress=False)), enable_prefix_caching=False)

    def one_pass(seed: int) -> None:
        reqs = workload("mix32", 48, llm.engine.model_config.vocab_size, seed=seed)
        llm.generate(
            [p for p, _ in reqs],
            [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs],
        )

    one_pass(0)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    one_pass(1)
    profile.disable()
    print(f"wall {time.perf_counter() - start:.2f} s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
