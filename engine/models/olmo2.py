"""OLMo 2: norms *after* attention and MLP (none before), and q/k RMSNorms over all heads of a
token at once rather than per head."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norms import FlatHeadsRMSNorm, RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import CausalLM, PostNormLayer, RankHeads, attention_spec, rotary


def olmo2_layer(
    cfg: ModelConfig, layer: int, rope: RotaryEmbedding, parallel: ParallelState
) -> PostNormLayer:
    hf, eps = cfg.hf, cfg.hf.rms_norm_eps
    spec = attention_spec(cfg, layer, qkv_bias=hf.attention_bias, o_bias=hf.attention_bias)
    heads, d = RankHeads.of(cfg, parallel), cfg.head_dim
    attn = SelfAttention(
        spec,
        rope,
        q_norm=FlatHeadsRMSNorm(cfg.num_heads, d, eps, heads.query, parallel=parallel),
        k_norm=FlatHeadsRMSNorm(cfg.num_kv_heads, d, eps, heads.kv, heads.kv_replicas, parallel),
        parallel=parallel,
    )
    mlp = GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act, parallel=parallel)
    return PostNormLayer(attn, mlp, RMSNorm(cfg.hidden_size, eps), RMSNorm(cfg.hidden_size, eps))


class Olmo2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        rope = rotary(cfg, max_positions)
        layers = [olmo2_layer(cfg, i, rope, parallel) for i in range(cfg.num_layers)]
        super().__init__(cfg, layers, RMSNorm(cfg.hidden_size, cfg.hf.rms_norm_eps), parallel=parallel)
