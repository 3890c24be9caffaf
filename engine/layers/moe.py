"""Mixture of experts: a top-k softmax router and experts computed grouped by expert.

Token-expert pairs are sorted by expert, so each expert runs one matmul over all the tokens
that picked it (a loop over experts, never over tokens):

    experts [T, k] = [[2, 0], [2, 1], [0, 2]]   -> sorted pairs: expert 0: tokens 0, 2
                                                                   expert 1: token 1
                                                                   expert 2: tokens 0, 1, 2
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.activations import activation


@dataclasses.dataclass(frozen=True, slots=True)
class Routing:
    logits: torch.Tensor  # [T, E] router logits
    weights: torch.Tensor  # [T, k] weight of each chosen expert, logits' dtype
    experts: torch.Tensor  # [T, k] int64 chosen experts, most probable first


class TopKRouter(nn.Module):
    """softmax(x W^T) in fp32, the k most probable experts, optionally renormalised to sum to one."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, weights.to(logits.dtype), experts)


class Experts(nn.Module):
    """All experts' gated MLPs as two stacked parameters (gate rows then up rows, as GatedMLP)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = activation(act)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        # x: [T, hidden] -> sum over each token's k experts of weight * expert(x): [T, hidden]
        top_k = routing.experts.shape[1]
        flat_experts = routing.experts.reshape(-1)  # [T * k], pair p belongs to token p // k
        order = torch.argsort(flat_experts, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0]).tolist()
        flat_weights = routing.weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]  # [n]
            start += count
            tokens = pairs // top_k
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(self.act(gate) * up, self.down_proj[expert])  # [n, hidden]
            out.index_add_(0, tokens, y * flat_weights[pairs, None])
        return out
