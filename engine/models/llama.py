"""Llama family: Llama 2/3, SmolLM2, Mistral (sliding window), Qwen2 (q/k/v bias)."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norms import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import CausalLM, PreNormLayer, attention_spec, rotary


def llama_layer(cfg: ModelConfig, layer: int, rope: RotaryEmbedding, parallel: ParallelState) -> PreNormLayer:
    hf = cfg.hf
    attention_bias = getattr(hf, "attention_bias", False)
    qkv_bias = cfg.architecture == "Qwen2ForCausalLM" or attention_bias
    attn = SelfAttention(
        attention_spec(cfg, layer, qkv_bias=qkv_bias, o_bias=attention_bias), rope, parallel=parallel
    )
    mlp_bias = getattr(hf, "mlp_bias", False)
    mlp = GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act, mlp_bias, parallel)
    return PreNormLayer(
        attn, mlp, RMSNorm(cfg.hidden_size, hf.rms_norm_eps), RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
    )


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        rope = rotary(cfg, max_positions)
        layers = [llama_layer(cfg, i, rope, parallel) for i in range(cfg.num_layers)]
        super().__init__(cfg, layers, RMSNorm(cfg.hidden_size, cfg.hf.rms_norm_eps), parallel=parallel)
