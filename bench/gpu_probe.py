"""The one-shot's engine probe: does an engine start and generate on this device?

A seeded tiny Llama of 512 positions (tests/tiny_models.py) with the engine's defaults: on CUDA
that is a pool sized after a profile run of the default 2048-token budget, longer than the model's
context (the first GPU run's certain crash, before the profile kept to the context), then CUDA
graphs. Prints the engine's start-up line and ``engine probe: ok, greedy tokens [...]``. With
``--group-of-one``, the same greedy run on an engine whose executor runs its collectives over a
group of one (NCCL on CUDA), checked against the plain engine's tokens: ``executor over a nccl
group of one: ok``. It is its own step of the one-shot, so that an NCCL failure costs no other row.

    python bench/gpu_probe.py                      # on the GPU (bench/gpu_oneshot.sh's probe step)
    python bench/gpu_probe.py --group-of-one       # its nccl step
    PDSERVE_TEST_PLATFORM=split python bench/gpu_probe.py --device cpu   # the same path on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

from pdserve import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--group-of-one", action="store_true", help="also over a torch.distributed group of one"
    )
    args = parser.parse_args(argv)
    llm = LLM(str(make_tiny_model("llama")), device=args.device)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8, 9]], params)
    want, config = out[0].outputs[0].token_ids, llm.engine.config
    print("engine probe: ok, greedy tokens", want, flush=True)
    if args.group_of_one:
        del llm, out  # its pool goes: the next engine sizes its own from the device's memory
        gc.collect()
        group_of_one(config, want)
    return 0


def group_of_one(config, want: list[int]) -> None:
    """The tensor-parallel executor at one rank over a torch.distributed group of one (NCCL on
    CUDA, gloo on the CPU): the layers' all-reduces and the LM head's all-gather run for real, and
    greedy decoding gives the plain engine's tokens."""
    import torch

    from pdserve.engine.llm_engine import LLMEngine

    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the first engine's pool, back to the device
    engine = LLMEngine(dataclasses.replace(config, enforce_eager=True), group_of_one=True)
    try:
        backend = torch.distributed.get_backend(engine.executor.parallel.group)
        engine.add_request(
            "group", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=len(want), ignore_eos=True)
        )
        got: list[int] = []
        while engine.has_work():
            for out in engine.step().outputs:
                got = out.outputs[0].token_ids
        assert got == want, (got, want)
        print(f"executor over a {backend} group of one: ok, greedy tokens equal", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # After the group of one is destroyed, a gloo or store thread of torch.distributed may still be
    # joinable when the interpreter tears down, and its destructor aborts a probe that passed
    # ("terminate called without an active exception", exit 134: once in a CI run under load).
    # The probe's answer is printed: leave without C++ static destructors.
    os._exit(code)
