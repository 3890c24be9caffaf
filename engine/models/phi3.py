"""Phi-3: the Llama layer with q/k/v and gate/up already fused in the checkpoint (``qkv_proj``,
``gate_up_proj``: our own parameter names, so they load as they are), LongRoPE scaling and
partial rotary (Phi-4-mini) through the shared rotary embedding."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norms import RMSNorm
from pdserve.engine.models.decoder import CausalLM, PreNormLayer, attention_spec, rotary


class Phi3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        hf, rope = cfg.hf, rotary(cfg, max_positions)
        eps = hf.rms_norm_eps
        layers = [
            PreNormLayer(
                SelfAttention(attention_spec(cfg, i), rope, parallel=parallel),
                GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act, parallel=parallel),
                RMSNorm(cfg.hidden_size, eps),
                RMSNorm(cfg.hidden_size, eps),
            )
            for i in range(cfg.num_layers)
        ]
        super().__init__(cfg, layers, RMSNorm(cfg.hidden_size, eps), parallel=parallel)
