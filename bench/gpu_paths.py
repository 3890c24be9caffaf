"""The one-shot's paths row: beam search and speculation (n-gram and a draft model) on this device,
against the plain CPU engine's tokens on the same seeded tiny models, in fp32 (exact on both).

    python bench/gpu_paths.py                      # on the GPU (bench/gpu_oneshot.sh's paths step)
    PDSERVE_TEST_PLATFORM=split python bench/gpu_paths.py --device cpu   # the same path on the CPU

Prints one line per path, ``path NAME: ok`` or ``path NAME: differs ...``, and exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.engine.executor.platform import TEST_PLATFORM_ENV  # noqa: E402
from pdserve.protocol.sampling_params import BeamSearch  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 40, 3, 99, 17, 2, 250]]  # the first repeats: n-gram drafts it


def paths() -> dict[str, tuple[str, dict, SamplingParams]]:
    """Each path: (model, engine options, sampling)."""
    llama, draft = str(make_tiny_model("llama")), str(make_tiny_model("llama", seed=3))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    beams = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True, beam_search=BeamSearch())
    return {
        "beam search (3 beams)": (str(make_tiny_model("qwen2")), {}, beams),
        "ngram speculation": (llama, {"speculative": "ngram", "num_speculative_tokens": 3}, greedy),
        "draft-model speculation": (llama, {"speculative_model": draft, "num_speculative_tokens": 3}, greedy),
    }


def tokens(model: str, device: str, options: dict, params: SamplingParams) -> list[list[list[int]]]:
    llm = LLM(model, device=device, dtype="float32", block_size=8, max_num_seqs=8, **options)
    try:
        return [[o.token_ids for o in out.outputs] for out in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.close()
        del llm
        gc.collect()


def cpu_tokens(model: str, options: dict, params: SamplingParams) -> list[list[list[int]]]:
    """The plain CPU engine's (the split platform off for it)."""
    saved = os.environ.pop(TEST_PLATFORM_ENV, None)
    try:
        return tokens(model, "cpu", options, params)
    finally:
        if saved is not None:
            os.environ[TEST_PLATFORM_ENV] = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    failed = 0
    for name, (model, options, params) in paths().items():
        want, got = cpu_tokens(model, options, params), tokens(model, args.device, options, params)
        ok = got == want
        failed += not ok
        print(
            f"path {name}: ok" if ok else f"path {name}: differs, {got} against the CPU's {want}", flush=True
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
