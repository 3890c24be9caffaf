"""Write a model as a compressed-tensors W8A8 checkpoint (llm-compressor's W8A8 preset: int8
weights per output channel by min-max, dynamic int8 activations per token), the format vLLM's
CPU build loads, so both engines can run the same int8 weights side by side:

    .venv/bin/python bench/w8a8_checkpoint.py --out /tmp/smollm2-w8a8      # the default model
    .venv/bin/python bench/vllm_compare.py --vllm-python /work/vllm-venv/bin/python \\
        --model /tmp/smollm2-w8a8 --workload mix32 --num-prompts 48 --dtype bfloat16 --passes 2

pdserve reads it as int8 without a flag (engine/weights.py); the int8 values are the ones its
``--quantization int8`` makes from the float weights when the scales are float32.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.test_int8_weights import w8a8_checkpoint  # noqa: E402  (the tests' writer, one copy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="a model folder with one model.safetensors (default: the default model)"
    )
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--scale-dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    if args.model is None:
        from pdserve.engine.model_fetch import fetch_default_model

        source = fetch_default_model(progress=False)
    else:
        source = pathlib.Path(args.model)
    folder = w8a8_checkpoint(source, args.out, getattr(torch, args.scale_dtype))
    print(folder)


if __name__ == "__main__":
    main()
