"""The device KV-transfer path between two processes on one GPU: a prefill and a decode node, each
on cuda:0 with 30% of it, their KV packed from and landed into device pools (the split platform's
emulation of it runs on the CPU in tests/test_platform.py). GPU only; bench/gpu_oneshot.sh's
transfer row runs it, with pyzmq from .whl/."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.usefixtures("processes")
def test_a_prefill_decode_pair_on_one_gpu_gives_the_cpu_engines_tokens(tmp_path):
    from tests.cluster import Client, NodeProcess

    model = str(make_tiny_model("llama"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 40, 17, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cpu = LLM(model=model, device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    extra = ["--device", "cuda", "--dtype", "float32", "--block-size", "8", "--gpu-memory-utilization", "0.3"]
    nodes = [NodeProcess(role, model, tmp_path, None, extra) for role in ("prefill", "decode")]
    client = Client()
    try:
        prefill, decode = (n.wait_ready() for n in nodes)
        wire = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 8}
        for i, p in enumerate(prompts):
            client.generate(prefill, f"g{i}", p, wire, decode=decode)
        results = client.collect([f"g{i}" for i in range(len(prompts))])
        assert [results[f"g{i}"]["tokens"] for i in range(len(prompts))] == want
        assert all(results[f"g{i}"]["failed"] is None for i in range(len(prompts)))
    finally:
        client.close()
        for n in nodes:
            n.close()
