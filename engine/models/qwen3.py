"""Qwen3: the Llama layer with an RMSNorm over each query and key head before the rotation."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norms import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import CausalLM, PreNormLayer, attention_spec, rotary


def qwen3_attention(
    cfg: ModelConfig, layer: int, rope: RotaryEmbedding, parallel: ParallelState
) -> SelfAttention:
    hf = cfg.hf
    spec = attention_spec(cfg, layer, qkv_bias=hf.attention_bias, o_bias=hf.attention_bias)
    return SelfAttention(
        spec,
        rope,
        q_norm=RMSNorm(cfg.head_dim, hf.rms_norm_eps),
        k_norm=RMSNorm(cfg.head_dim, hf.rms_norm_eps),
        parallel=parallel,
    )


def qwen3_layer(cfg: ModelConfig, layer: int, rope: RotaryEmbedding, parallel: ParallelState) -> PreNormLayer:
    hf = cfg.hf
    mlp = GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act, parallel=parallel)
    return PreNormLayer(
        qwen3_attention(cfg, layer, rope, parallel),
        mlp,
        RMSNorm(cfg.hidden_size, hf.rms_norm_eps),
        RMSNorm(cfg.hidden_size, hf.rms_norm_eps),
    )


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        rope = rotary(cfg, max_positions)
        layers = [qwen3_layer(cfg, i, rope, parallel) for i in range(cfg.num_layers)]
        super().__init__(cfg, layers, RMSNorm(cfg.hidden_size, cfg.hf.rms_norm_eps), parallel=parallel)
