"""Gemma: embeddings scaled by sqrt(hidden_size), GeGLU MLP, (1 + w) RMSNorm, tied LM head."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norms import RMSNorm
from pdserve.engine.models.decoder import CausalLM, PreNormLayer, attention_spec, rotary


def gemma_norm(cfg: ModelConfig) -> RMSNorm:
    return RMSNorm(cfg.hidden_size, cfg.hf.rms_norm_eps, unit_offset=True)


class GemmaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        hf, rope = cfg.hf, rotary(cfg, max_positions)
        layers = [
            PreNormLayer(
                SelfAttention(
                    attention_spec(cfg, i, qkv_bias=hf.attention_bias, o_bias=hf.attention_bias),
                    rope,
                    parallel=parallel,
                ),
                GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act, parallel=parallel),
                gemma_norm(cfg),
                gemma_norm(cfg),
            )
            for i in range(cfg.num_layers)
        ]
        super().__init__(cfg, layers, gemma_norm(cfg), embed_scale=cfg.hidden_size**0.5, parallel=parallel)
