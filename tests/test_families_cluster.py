"""1 prefill + 1 decode node per KV-layout difference, greedy output equal to HF: per-layer
sliding windows with soft-capping (Gemma 2, head_dim 16), a head_dim that is not hidden / heads
(Qwen3, 32), and mixture of experts (Qwen2-MoE). The three pairs start together."""

from __future__ import annotations

import pytest
import torch

from tests.cluster import Client, NodeProcess
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.usefixtures("processes")
KINDS = ["gemma2", "qwen3", "qwen2_moe"]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """kind -> (prefill addrs, decode addrs); processes started at once so their start-ups overlap."""
    tmp = tmp_path_factory.mktemp("families")
    extra = ["--block-size", "8", "--num-kv-blocks", "32"]
    procs = {
        kind: [
            NodeProcess(role, str(make_tiny_model(kind)), tmp, None, extra) for role in ("prefill", "decode")
        ]
        for kind in KINDS
    }
    try:
        yield {kind: tuple(p.wait_ready() for p in pair) for kind, pair in procs.items()}
    finally:
        for pair in procs.values():
            for p in pair:
                p.close()


@pytest.fixture(scope="module")
def client():
    c = Client()
    yield c
    c.close()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_decode_node_matches_hf(kind, pairs, client):
    model = str(make_tiny_model(kind))
    prefill, decode = pairs[kind]
    g = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, 256, (n,), generator=g).tolist() for n in (29, 12)
    ]  # past Gemma 2's window of 8
    for i, p in enumerate(prompts):
        client.generate(prefill, f"{kind}-{i}", p, {**GREEDY, "max_tokens": 10}, decode=decode)
    results = client.collect([f"{kind}-{i}" for i in range(len(prompts))])
    for i, p in enumerate(prompts):
        r = results[f"{kind}-{i}"]
        assert r["failed"] is None and r["finish"] == "length"
        assert r["tokens"] == hf_greedy(model, p, 10), f"request {i}"
    for node in (prefill, decode):
        info = client.wait_idle(node)
        assert info["num_blocks_free"] == info["num_blocks_total"], info
