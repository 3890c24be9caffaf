"""The GPU code path on CPU CI: the engine and a 1P+1D cluster with ``--attention-backend triton``
(Triton's interpreter on CPU tensors) give Hugging Face's greedy output."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.cluster import Client, NodeProcess
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

CASES = pathlib.Path(__file__).with_name("triton_backend_cases.py")
GREEDY = {"temperature": 0.0, "ignore_eos": True}
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels run directly")


@pytest.mark.usefixtures("processes")
@no_gpu
def test_engine_cases_with_the_triton_backend_match_hf():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(CASES)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and summary.startswith("6 passed"), (
        result.stdout[-6000:] + result.stderr[-3000:]
    )


@pytest.mark.usefixtures("processes")
@no_gpu
def test_a_prefill_decode_pair_with_the_triton_backend_matches_hf(tmp_path):
    model = str(make_tiny_model("llama"))
    extra = ["--num-kv-blocks", "64", "--block-size", "8", "--attention-backend", "triton"]
    prefill = NodeProcess("prefill", model, tmp_path, None, extra)  # each turns the interpreter on itself
    decode = NodeProcess("decode", model, tmp_path, None, extra)
    client = Client()
    try:
        p, d = prefill.wait_ready(), decode.wait_ready()
        prompts = {"x": list(range(3, 40)), "y": list(range(60, 71))}
        for rid, prompt in prompts.items():
            client.generate(p, rid, prompt, {**GREEDY, "max_tokens": 6}, decode=d)
        got = client.collect(list(prompts), timeout_s=120)
        for rid, prompt in prompts.items():
            assert got[rid]["tokens"] == hf_greedy(model, prompt, 6)
        assert "Triton's interpreter" in prefill.log() and "Triton's interpreter" in decode.log()
    finally:
        client.close()
        prefill.close()
        decode.close()
