"""Tiny configs of the families beyond Llama, each shaped to exercise what sets it apart.

Sizes stay tiny (2 layers, hidden <= 64, vocab 256); head dims are never 64 and often not
hidden_size / num_heads. Kinds ending in a rotary variant's name only change the rotation.
"""

from __future__ import annotations

import transformers

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    eos_token_id=2,
    bos_token_id=1,
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 32,
    "factor": 8.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
    "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0],
}

FAMILY_CONFIGS = {
    # q/k RMSNorm per head; head_dim 32 while hidden / heads is 16
    "qwen3": lambda: transformers.Qwen3Config(**BASE, head_dim=32),
    "qwen3-yarn": lambda: transformers.Qwen3Config(
        **{**BASE, "max_position_embeddings": 128}, head_dim=32, rope_parameters=YARN
    ),
    # sqrt(hidden) embedding scale, GeGLU, (1 + w) norms, tied head; one KV head of 32 channels
    "gemma": lambda: transformers.GemmaConfig(**{**BASE, "num_key_value_heads": 1}, head_dim=32),
    "gemma-linear": lambda: transformers.GemmaConfig(
        **{**BASE, "num_key_value_heads": 1},
        head_dim=32,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    ),
    # sliding (window 8) then global layer; caps small enough to bend the tiny model's logits
    "gemma2": lambda: transformers.Gemma2Config(
        **BASE,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # fused qkv / gate_up in the checkpoint; LongRoPE switching sets at position 32; head_dim 12
    "phi3": lambda: transformers.Phi3Config(
        **{**BASE, "hidden_size": 48}, rope_parameters=LONGROPE, pad_token_id=0
    ),
    # learned positions, LayerNorm, Conv1D, GELU, 4 heads of 16 with no GQA
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=256, eos_token_id=2, bos_token_id=1
    ),
    # partial rotary (a quarter of each 16-channel head), LayerNorm with bias, q/k/v bias
    "stablelm": lambda: transformers.StableLmConfig(**BASE, use_qkv_bias=True),
    # StableLM 2 12B's shape: parallel residual and a LayerNorm per q/k head
    "stablelm-parallel": lambda: transformers.StableLmConfig(
        **BASE, use_parallel_residual=True, qk_layernorm=True
    ),
    # norms after attention and MLP only; q/k norms over all heads (4 x 16 and 2 x 16 channels)
    "olmo2": lambda: transformers.Olmo2Config(**BASE, pad_token_id=0),
    # layer 0 dense, layer 1 sparse: 8 experts, top 2 renormalised, plus a gated shared expert
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **BASE,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    # 4 experts of 48, top 2 renormalised, no shared expert; window 16 on every layer
    "mixtral": lambda: transformers.MixtralConfig(
        **BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=16
    ),
    # dynamic NTK: the plain rotation while the context stays within max_position_embeddings
    "qwen2-dynamic": lambda: transformers.Qwen2Config(
        **BASE, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    ),
}
