"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 layer with a sparse MoE block in place of
the MLP (every ``decoder_sparse_step``-th layer, except ``mlp_only_layers``): top-k routed
experts plus a shared expert scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.moe import Experts, TopKRouter
from pdserve.engine.layers.norms import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import CausalLM, PreNormLayer, attention_spec, rotary, single_rank_only


class Qwen2MoeSparseBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf, width = cfg.hf, cfg.hidden_size
        self.gate = TopKRouter(width, hf.num_experts, hf.num_experts_per_tok, hf.norm_topk_prob)
        self.experts = Experts(hf.num_experts, width, hf.moe_intermediate_size, hf.hidden_act)
        self.shared_expert = GatedMLP(width, hf.shared_expert_intermediate_size, hf.hidden_act)
        self.shared_expert_gate = nn.Linear(width, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, self.gate(x)) + shared


def qwen2_moe_layer(cfg: ModelConfig, layer: int, rope: RotaryEmbedding) -> PreNormLayer:
    hf = cfg.hf
    sparse = (
        layer not in hf.mlp_only_layers and hf.num_experts > 0 and (layer + 1) % hf.decoder_sparse_step == 0
    )
    mlp = (
        Qwen2MoeSparseBlock(cfg) if sparse else GatedMLP(cfg.hidden_size, hf.intermediate_size, hf.hidden_act)
    )
    attn = SelfAttention(attention_spec(cfg, layer, qkv_bias=hf.qkv_bias), rope)
    return PreNormLayer(
        attn, mlp, RMSNorm(cfg.hidden_size, hf.rms_norm_eps), RMSNorm(cfg.hidden_size, hf.rms_norm_eps)
    )


class Qwen2MoeForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        single_rank_only(cfg, parallel.tp_size, "its experts are not sharded")
        rope = rotary(cfg, max_positions)
        layers = [qwen2_moe_layer(cfg, i, rope) for i in range(cfg.num_layers)]
        super().__init__(cfg, layers, RMSNorm(cfg.hidden_size, cfg.hf.rms_norm_eps))
