"""Gemma 2: Gemma's embeddings, norms and GeGLU, plus norms before *and* after attention and MLP,
sliding-window and global layers alternating (``layer_types``), soft-capped attention logits and
final logits, and attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import CausalLM, SandwichLayer, attention_spec, rotary
from pdserve.engine.models.gemma import gemma_norm


def gemma2_layer(
    cfg: ModelConfig, layer: int, rope: RotaryEmbedding, parallel: ParallelState
) -> SandwichLayer:
    hf = cfg.hf
    spec = attention_spec(
        cfg,
        layer,
        qkv_bias=hf.attention_bias,
        o_bias=hf.attention_bias,
        scale=hf.query_pre_attn_scalar**-0.5,
        softcap=hf.attn_logit_softcapping,
    )
    mlp = GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_activation, parallel=parallel)
    return SandwichLayer(
        SelfAttention(spec, rope, parallel=parallel), mlp, [gemma_norm(cfg) for _ in range(4)]
    )


class Gemma2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        rope = rotary(cfg, max_positions)
        layers = [gemma2_layer(cfg, i, rope, parallel) for i in range(cfg.num_layers)]
        super().__init__(
            cfg,
            layers,
            gemma_norm(cfg),
            embed_scale=cfg.hidden_size**0.5,
            logit_softcap=cfg.hf.final_logit_softcapping,
            parallel=parallel,
        )
