"""Loading real checkpoints: sharded safetensors with an index, tied and untied embeddings, bf16
checkpoints into an fp32 engine and fp32 ones into a bf16 engine, and clear start-up errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pdserve.engine import LLM
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.executor.model_runner import ModelRunner
from pdserve.protocol.kv_layout import KVCacheSpec
from tests.engine_helpers import hf_logits, paged_logits
from tests.tiny_models import make_tiny_model

TOKENS = list(range(3, 23))


def _runner(path: str, dtype: str = "float32") -> ModelRunner:
    cfg = ModelConfig.from_path(path)
    spec = KVCacheSpec(cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim, dtype)
    return ModelRunner(cfg, EngineConfig(model=path, dtype=dtype), spec)


def _resave(kind: str, dst, dtype: torch.dtype = torch.float32, **save_args) -> str:
    model = transformers.AutoModelForCausalLM.from_pretrained(make_tiny_model(kind), dtype=dtype)
    model.save_pretrained(dst, **save_args)
    return str(dst)


def test_sharded_checkpoint_with_index_loads_the_same_weights(tmp_path):
    sharded = _resave("qwen2_moe", tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    single = paged_logits(str(make_tiny_model("qwen2_moe")), TOKENS, chunks=[20])
    assert torch.equal(paged_logits(sharded, TOKENS, chunks=[20]), single)


def test_tied_head_shares_the_embedding_and_untied_head_loads_its_own(monkeypatch):
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")  # packing copies the head (tests/test_cpu_linear.py)
    tied = _runner(str(make_tiny_model("gemma"))).model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    path = str(make_tiny_model("qwen3"))
    untied = _runner(path).model
    stored = load_file(f"{path}/model.safetensors")
    assert torch.equal(untied.lm_head.weight, stored["lm_head.weight"])
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_bf16_checkpoint_runs_in_fp32_exactly_like_hf(tmp_path):
    path = _resave("phi3", tmp_path / "bf16", dtype=torch.bfloat16)
    assert load_file(f"{path}/model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    ours = paged_logits(path, TOKENS, chunks=[20])  # the engine runs fp32 by default
    assert (ours - hf_logits(path, TOKENS)).abs().max().item() < 1e-4


def test_fp32_checkpoint_loads_into_bf16_rounded_once():
    path = str(make_tiny_model("qwen3"))
    stored = load_file(f"{path}/model.safetensors")
    layer = _runner(path, "bfloat16").model.model.layers[0]
    qkv = torch.cat([stored[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"])
    proj = layer.self_attn.qkv_proj  # packed for oneDNN where this CPU runs bf16 matmuls so
    weight = proj.weight if proj.packed_weight is None else proj.packed_weight.to_dense()
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, qkv.to(torch.bfloat16))
    assert torch.equal(
        layer.self_attn.q_norm.weight, stored["model.layers.0.self_attn.q_norm.weight"].bfloat16()
    )


def test_checkpoint_missing_a_tensor_fails_naming_it(tmp_path):
    dst = tmp_path / "missing"
    shutil.copytree(make_tiny_model("gpt2"), dst)
    tensors = load_file(f"{dst}/model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint lacks parameters: \['transformer.h.1.mlp.c_fc.bias'\]"):
        _runner(str(dst))


def test_model_type_unknown_to_transformers_fails_at_start_up(tmp_path):
    dst = tmp_path / "unknown"
    shutil.copytree(make_tiny_model("gpt2"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-family"}))
    with pytest.raises(ValueError, match="model_type 'no-such-family'"):
        LLM(str(dst))


def test_gpt2_checkpoint_in_openai_naming_with_mask_buffers_loads(tmp_path):
    # openai-community/gpt2 names tensors without "transformer." and stores the causal masks.
    src = make_tiny_model("gpt2")
    dst = tmp_path / "openai-names"
    shutil.copytree(src, dst)
    tensors = {
        name.removeprefix("transformer."): t for name, t in load_file(f"{src}/model.safetensors").items()
    }
    tensors.pop("lm_head.weight", None)
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
    save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})
    assert torch.equal(
        paged_logits(str(dst), TOKENS, chunks=[20]), paged_logits(str(src), TOKENS, chunks=[20])
    )
