"""bfloat16 nodes end to end: a prefill node's bf16 KV blocks over ZeroMQ to a bf16 decode node,
beside requests the decode node prefills itself, all at once. bf16 cannot equal fp32 HF token for
token, so each token must be near-greedy under fp32 HF on the sequence the nodes produced."""

from __future__ import annotations

import pytest
import torch

from tests.cluster import Client, NodeProcess
from tests.engine_helpers import hf_logits
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    extra = ["--dtype", "bfloat16", "--block-size", "8", "--num-kv-blocks", "96"]
    procs = [
        NodeProcess(role, str(make_tiny_model("llama")), tmp, None, extra) for role in ("prefill", "decode")
    ]
    try:
        yield tuple(p.wait_ready() for p in procs)
    finally:
        for p in procs:
            p.close()


def test_bf16_prefill_to_decode_and_decode_only_track_fp32_hf(pair):
    model = str(make_tiny_model("llama"))
    prefill, decode = pair
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 40, 17, 61, 9, 28)]
    client = Client()
    try:
        params = {"temperature": 0.0, "ignore_eos": True, "max_tokens": MAX_TOKENS}
        for i, p in enumerate(prompts):  # even: through the prefill node; odd: the decode node alone
            if i % 2 == 0:
                client.generate(prefill, f"r{i}", p, params, decode=decode)
            else:
                client.generate(decode, f"r{i}", p, params)
        results = client.collect([f"r{i}" for i in range(len(prompts))])
        for i, p in enumerate(prompts):
            r = results[f"r{i}"]
            assert r["failed"] is None and r["finish"] == "length", r
            assert len(r["tokens"]) == MAX_TOKENS
            logprobs = torch.log_softmax(hf_logits(model, p + r["tokens"])[len(p) - 1 : -1], dim=-1)
            chosen = logprobs.gather(1, torch.tensor(r["tokens"])[:, None])[:, 0]
            assert (logprobs.max(dim=-1).values - chosen).max().item() < 0.1, f"request {i}"
        for node in (prefill, decode):
            info = client.wait_idle(node)
            assert info["num_blocks_free"] == info["num_blocks_total"], info
    finally:
        client.close()
