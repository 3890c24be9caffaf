"""The self-attention block over the paged KV cache: fused qkv projection, optional per-head
q/k norms, rotary embedding, paged attention (window and logit soft-capping per layer), o_proj."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pdserve.engine.executor.attention import AttentionMetadata, paged_attention
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from pdserve.engine.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each [num_blocks, block_size, KVH, D]


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionSpec:
    """One layer's attention shape and variant."""

    hidden_size: int  # model width
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int  # channels per head, any size (not tied to hidden_size / num_heads)
    scale: float  # multiplies q.k: head_dim ** -0.5, or Gemma 2's query_pre_attn_scalar ** -0.5
    qkv_bias: bool = False  # Qwen2, StableLM, GPT-2
    o_bias: bool = False  # GPT-2
    sliding_window: int | None = None  # attend to at most this many most recent tokens (this layer)
    softcap: float | None = None  # Gemma 2: logits -> softcap * tanh(logits / softcap)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )


class SelfAttention(nn.Module):
    """``q_norm`` / ``k_norm`` act on [T, heads, head_dim] before the rotation (Qwen3 per head,
    OLMo 2 over all heads). Under tensor parallelism each rank computes its share of the heads
    (``spec`` then holds this rank's counts) and o_proj sums the ranks' outputs."""

    def __init__(
        self,
        spec: AttentionSpec,
        rope: RotaryEmbedding | None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        parallel: ParallelState = SINGLE,
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, parallel, spec.qkv_bias
        )
        local = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.spec = spec = dataclasses.replace(spec, num_heads=local[0], num_kv_heads=local[1])
        self.q_size = spec.num_heads * spec.head_dim
        d, q_heads = spec.head_dim, self.qkv_proj.q_heads
        columns = range(q_heads.start * d, q_heads.stop * d)  # the channels of this rank's heads
        self.o_proj = RowParallelLinear(
            self.qkv_proj.fused_parts[0][1], spec.hidden_size, parallel, bias=spec.o_bias, columns=columns
        )
        self.rope = rope
        self.q_norm, self.k_norm = q_norm, k_norm

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        # x: [T, hidden]
        q, k, v = split_heads(self.qkv_proj(x), self.spec)  # [T, H|KVH|KVH, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None and self.rope.can_rotate_in_place(q) and self.rope.can_rotate_in_place(k):
            self.rope.rotate_(positions, q)  # the CPU kernel, in place (q, k: views of fresh tensors)
            self.rope.rotate_(positions, k)
        elif self.rope is not None:
            q, k = self.rope(positions, torch.cat([q, k], dim=1)).split([q.shape[1], k.shape[1]], dim=1)
        out = attend(q, k, v, kv_cache, meta, self.spec)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))


def split_heads(qkv: torch.Tensor, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # qkv: [T, (H + 2 * KVH) * D] -> q [T, H, D], k [T, KVH, D], v [T, KVH, D]
    heads = qkv.view(qkv.shape[0], spec.num_heads + 2 * spec.num_kv_heads, spec.head_dim)
    return heads.split([spec.num_heads, spec.num_kv_heads, spec.num_kv_heads], dim=1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    meta: AttentionMetadata,
    spec: AttentionSpec,
) -> torch.Tensor:
    # q: [T, H, D]; k, v: [T, KVH, D] -> [T, H, D]
    return paged_attention(
        q, k, v, kv_cache[0], kv_cache[1], meta, spec.scale, spec.sliding_window, spec.softcap
    )
