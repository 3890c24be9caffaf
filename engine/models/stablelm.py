"""StableLM (2 / 3B): LayerNorm with bias, partial rotary (the first quarter of each head by
default), optional q/k/v bias, optional per-head q/k LayerNorms (StableLM 2 12B), and optionally
a parallel residual (attention and MLP read the same normed input)."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norms import LayerNorm, PerHeadLayerNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import (
    CausalLM,
    ParallelLayer,
    PreNormLayer,
    RankHeads,
    attention_spec,
    rotary,
)


def stablelm_layer(
    cfg: ModelConfig, layer: int, rope: RotaryEmbedding, parallel: ParallelState
) -> PreNormLayer | ParallelLayer:
    hf = cfg.hf
    q_norm = k_norm = None
    if hf.qk_layernorm:
        heads = RankHeads.of(cfg, parallel)
        q_norm = PerHeadLayerNorm(cfg.num_heads, cfg.head_dim, hf.layer_norm_eps, heads.query)
        k_norm = PerHeadLayerNorm(cfg.num_kv_heads, cfg.head_dim, hf.layer_norm_eps, heads.kv)
    spec = attention_spec(cfg, layer, qkv_bias=hf.use_qkv_bias)
    attn = SelfAttention(spec, rope, q_norm, k_norm, parallel)
    mlp = GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act, parallel=parallel)
    if hf.use_parallel_residual:
        return ParallelLayer(attn, mlp, LayerNorm(cfg.hidden_size, eps=hf.layer_norm_eps))
    return PreNormLayer(
        attn,
        mlp,
        LayerNorm(cfg.hidden_size, eps=hf.layer_norm_eps),
        LayerNorm(cfg.hidden_size, eps=hf.layer_norm_eps),
    )


class StableLmForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        rope = rotary(cfg, max_positions)
        layers = [stablelm_layer(cfg, i, rope, parallel) for i in range(cfg.num_layers)]
        super().__init__(
            cfg, layers, LayerNorm(cfg.hidden_size, eps=cfg.hf.layer_norm_eps), parallel=parallel
        )

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name.replace(".self_attn.q_layernorm.", ".self_attn.q_norm.").replace(
            ".self_attn.k_layernorm.", ".self_attn.k_norm."
        )
