"""A bf16 model is built and loaded in bf16: the process's peak stays near the weights' own bytes
(built in fp32 and then cast, it held about 3x them for a moment, and fused parts waiting to the
end of the load held most of the checkpoint a second time). Measured by bench/weights_memory.py
in a child process: anonymous memory, on the split platform (as on a GPU, no oneDNN packing)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch
import transformers

from tests.cluster import ROOT

pytestmark = pytest.mark.usefixtures("processes")  # a child process measures its own peak

# A 34M-parameter Llama, stored in bf16 as real checkpoints are: 68 MB of weights, enough that the
# interpreter's own noise is small beside them, while no single tensor is more than 1/8 of them.
CONFIG = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def bf16_checkpoint() -> pathlib.Path:
    path = pathlib.Path(tempfile.gettempdir()) / "pdserve-bf16-34m-v1"
    if not (path / "model.safetensors").is_file():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
    return path


def test_a_bf16_model_is_built_and_loaded_within_1_2x_its_weight_bytes():
    out = subprocess.run(
        [sys.executable, "bench/weights_memory.py", str(bf16_checkpoint())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["dtypes"] == ["torch.bfloat16"]
    assert figures["weights"] > 60e6
    assert figures["grew"] <= 1.2 * figures["weights"], figures
