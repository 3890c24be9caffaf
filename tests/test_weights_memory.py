"""A bf16 model is built and loaded in bf16: the process's peak stays near the weights' own bytes
(built in fp32 and then cast, it held about 3x them for a moment, and fused parts waiting to the
end of the load held most of the checkpoint a second time)."""

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

# Anonymous memory only (resident less file-backed pages, sampled every millisecond): the
# checkpoint's mapped pages are page cache, which the kernel reclaims and a GPU never holds. On
# the split platform, the CPU's stand-in for a GPU: no oneDNN packing, whose blocked layout (CPU
# only) adds about 8% to the weights.
MEASURE = """
import json, resource, sys, threading, time
import torch
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.platform import SplitPlatform

def anon_bytes():
    with open("/proc/self/statm") as f:
        _, resident, shared = map(int, f.read().split()[:3])
    return (resident - shared) * resource.getpagesize()

peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], anon_bytes())
        time.sleep(0.001)

model = ModelConfig.from_path(sys.argv[1])
config = EngineConfig(model=sys.argv[1], dtype="bfloat16")
before = anon_bytes()
sampler = threading.Thread(target=sample)
sampler.start()
runner = ModelRunner(model, config, platform=SplitPlatform())
done.set()
sampler.join()
print(json.dumps({"grew": peak[0] - before, "weights": runner.weight_bytes,
                  "dtypes": sorted({str(p.dtype) for p in runner.model.parameters()})}))
"""


def bf16_checkpoint() -> pathlib.Path:
    path = pathlib.Path(tempfile.gettempdir()) / "pdserve-bf16-34m-v1"
    if not (path / "model.safetensors").is_file():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).to(torch.bfloat16)
        model.save_pretrained(path, safe_serialization=True)
    return path


def test_a_bf16_model_is_built_and_loaded_within_1_2x_its_weight_bytes():
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(bf16_checkpoint())],
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
