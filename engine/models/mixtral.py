"""Mixtral: the Mistral layer with a sparse MoE block in place of the MLP: top-k experts, their
weights renormalised to sum to one, no shared expert. Checkpoints call the block
``block_sparse_moe`` and the experts' matrices w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import SelfAttention
from pdserve.engine.layers.moe import Experts, TopKRouter
from pdserve.engine.layers.norms import RMSNorm
from pdserve.engine.models.decoder import CausalLM, PreNormLayer, attention_spec, rotary, single_rank_only


class MixtralSparseBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf
        self.gate = TopKRouter(
            cfg.hidden_size, hf.num_local_experts, hf.num_experts_per_tok, renormalize=True
        )
        self.experts = Experts(hf.num_local_experts, cfg.hidden_size, hf.intermediate_size, hf.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # x: [T, hidden]


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        single_rank_only(cfg, parallel.tp_size, "its experts are not sharded")
        rope, eps = rotary(cfg, max_positions), cfg.hf.rms_norm_eps
        layers = [
            PreNormLayer(
                SelfAttention(attention_spec(cfg, i), rope),
                MixtralSparseBlock(cfg),
                RMSNorm(cfg.hidden_size, eps),
                RMSNorm(cfg.hidden_size, eps),
            )
            for i in range(cfg.num_layers)
        ]
        super().__init__(cfg, layers, RMSNorm(cfg.hidden_size, eps))

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return name.replace(".block_sparse_moe.", ".mlp.")
