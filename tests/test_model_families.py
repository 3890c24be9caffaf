"""Each architecture family beyond Llama, exact against Hugging Face on the same seeded weights:
teacher-forced logits (whole prompt and chunked over the paged cache), and greedy output of the
offline LLM API with chunked prefill and a prefix hit. The tiny configs: tests/tiny_families.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.executor.model_runner import ModelRunner
from pdserve.protocol.kv_layout import KVCacheSpec
from tests.engine_helpers import hf_greedy, hf_logits, hf_model, paged_logits
from tests.tiny_models import make_tiny_model

FAMILIES = ["qwen3", "gemma", "gemma2", "phi3", "gpt2", "stablelm", "olmo2", "qwen2_moe", "mixtral"]
VARIANTS = ["qwen3-yarn", "gemma-linear", "qwen2-dynamic", "stablelm-parallel"]  # rotary or residual variants


def _tokens(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("kind", FAMILIES + VARIANTS)
def test_teacher_forced_logits_match_hf_whole_and_chunked(kind):
    # 30 tokens: Phi-3's LongRoPE keeps its short factors (HF switches per pass past 32; see docs/serving.md)
    path = str(make_tiny_model(kind))
    tokens = _tokens(1, 30)
    ref = hf_logits(path, tokens)
    whole = paged_logits(path, tokens, chunks=[30])
    chunked = paged_logits(path, tokens, chunks=[7, 13, 1, 5, 1, 1, 1, 1], block_size=4)
    assert (whole - ref).abs().max().item() < 1e-4
    assert (chunked - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_matches_hf_with_chunked_prefill_and_a_prefix_hit(kind):
    # 30-token prompts under a 16-token budget; the second reuses the first's 3 full blocks.
    # 30 + 12 tokens cross Phi-3's switch to the long LongRoPE factors at position 32.
    path = str(make_tiny_model(kind))
    shared = _tokens(2, 24)
    prompts = [shared + _tokens(3, 6), shared + _tokens(4, 6)]
    llm = LLM(path, num_kv_blocks=32, block_size=8, max_num_batched_tokens=16)
    first = llm.generate([prompts[0]], _greedy(12))[0]
    second = llm.generate([prompts[1]], _greedy(12))[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 24)
    assert first.outputs[0].token_ids == hf_greedy(path, prompts[0], 12)
    assert second.outputs[0].token_ids == hf_greedy(path, prompts[1], 12)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def _variant(tmp_path, kind: str, **changes) -> str:
    dst = tmp_path / "-".join(changes)
    shutil.copytree(make_tiny_model(kind), dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return str(dst)


def test_gemma2_caps_and_window_each_change_the_logits(tmp_path):
    # So the HF match above really covers soft-capping and the sliding layer.
    path = str(make_tiny_model("gemma2"))
    tokens = _tokens(5, 20)
    base = paged_logits(path, tokens, chunks=[20])
    for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None}):
        other = paged_logits(_variant(tmp_path, "gemma2", **change), tokens, chunks=[20])
        assert (other - base).abs().max().item() > 1e-3, change
    windowless = paged_logits(_variant(tmp_path, "gemma2", layer_types=["full_attention"] * 2), tokens, [20])
    assert torch.allclose(windowless[:8], base[:8], atol=1e-6)  # the window of 8 acts only past 8 tokens
    assert (windowless[8:] - base[8:]).abs().max().item() > 1e-3


def test_dynamic_ntk_refuses_a_context_past_max_position_embeddings():
    # Within max_position_embeddings dynamic NTK is the plain rotation (exact above); past it HF
    # re-derives the frequencies per sequence length, which cached keys cannot follow.
    with pytest.raises(ValueError, match="rope_type 'dynamic'.*max_model_len"):
        LLM(str(make_tiny_model("qwen2-dynamic")), num_kv_blocks=8, max_model_len=512)


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_moe_router_logits_expert_choice_and_block_output_match_hf(kind):
    path = str(make_tiny_model(kind))
    cfg = ModelConfig.from_path(path)
    spec = KVCacheSpec(cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim, "float32")
    ours = (
        ModelRunner(cfg, EngineConfig(model=path, dtype="float32"), spec).model.model.layers[1].mlp
    )  # the sparse layer
    theirs = hf_model(path).model.layers[1].mlp
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))  # 32 picks of 8 or 4 experts
    with torch.no_grad():
        routing = ours.gate(x)
        hf_logits_, hf_weights, hf_experts = theirs.gate(x)
        assert torch.bincount(routing.experts.reshape(-1)).max().item() >= 4  # tokens share experts
        assert torch.equal(routing.experts, hf_experts)
        torch.testing.assert_close(routing.logits, hf_logits_, atol=1e-6, rtol=0)
        torch.testing.assert_close(routing.weights, hf_weights, atol=1e-6, rtol=0)
        torch.testing.assert_close(ours(x), theirs(x[None])[0], atol=1e-5, rtol=0)
