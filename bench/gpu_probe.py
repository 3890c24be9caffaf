"""The one-shot's engine probe: does an engine start and generate on this device?

A seeded tiny Llama of 512 positions (tests/tiny_models.py) with the engine's defaults: on CUDA
that is a pool sized after a profile run of the default 2048-token budget, longer than the model's
context (the first GPU run's certain crash, before the profile kept to the context), then CUDA
graphs. Prints the engine's start-up line and ``engine probe: ok, greedy tokens [...]``.

    python bench/gpu_probe.py                      # on the GPU (bench/gpu_oneshot.sh's probe step)
    PDSERVE_TEST_PLATFORM=split python bench/gpu_probe.py --device cpu   # the same path on the CPU
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

from pdserve import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    llm = LLM(str(make_tiny_model("llama")), device=args.device)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8, 9]], params)
    print("engine probe: ok, greedy tokens", out[0].outputs[0].token_ids, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
