"""The decoder skeleton that every model file fills in: embeddings, a stack of layers, a final
norm and the LM head, with HF's parameter names (``model.layers.<i>.self_attn...``).

A family file builds its layers from engine/layers and picks one of the residual shapes:

    PreNormLayer    x += attn(n1(x));  x += mlp(n2(x))             Llama, Qwen, Phi-3, StableLM, MoE
    SandwichLayer   x += n2(attn(n1(x)));  x += n4(mlp(n3(x)))     Gemma 2 (norms before and after)
    ParallelLayer   h = n1(x);  x += attn(h) + mlp(h)              StableLM with use_parallel_residual
    PostNormLayer   x += n1(attn(x));  x += n2(mlp(x))             OLMo 2 (norms after, none before)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.attention import AttentionMetadata
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.attention import AttentionSpec, KVCache
from pdserve.engine.layers.linear import ParallelLMHead, VocabParallelEmbedding
from pdserve.engine.layers.norms import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.protocol.kv_layout import kv_heads_of, query_heads_of


class PreNormLayer(nn.Module):
    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        input_layernorm: nn.Module,
        post_attention_layernorm: nn.Module,
    ) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = input_layernorm, self_attn
        self.post_attention_layernorm, self.mlp = post_attention_layernorm, mlp

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        # x, the stack's own activation, takes the attention's residual in place
        attn = self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        norm = self.post_attention_layernorm
        if isinstance(norm, RMSNorm):
            h = norm.add_and_norm_(attn, x)  # x += attn; h = norm(x), in one pass on CPU
        else:
            x = x + attn
            h = norm(x)
        return x + self.mlp(h)


class SandwichLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norms: list[nn.Module]) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = norms[0], norms[1]
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norms[2], norms[3]

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), positions, kv_cache, meta)
        )
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class ParallelLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn, self.mlp = input_layernorm, self_attn, mlp

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, positions, kv_cache, meta) + self.mlp(h)


class PostNormLayer(nn.Module):
    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        post_attention_layernorm: nn.Module,
        post_feedforward_layernorm: nn.Module,
    ) -> None:
        super().__init__()
        self.self_attn, self.post_attention_layernorm = self_attn, post_attention_layernorm
        self.mlp, self.post_feedforward_layernorm = mlp, post_feedforward_layernorm

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class DecoderStack(nn.Module):
    """HF's ``model`` submodule: ``embed_tokens``, ``layers``, ``norm``."""

    def __init__(
        self, cfg: ModelConfig, layers: Sequence[nn.Module], norm: nn.Module, parallel: ParallelState
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """Token ids -> final hidden states -> logits. ``embed_scale``: Gemma multiplies the embeddings
    by sqrt(hidden_size); ``logit_softcap``: Gemma 2 bends the logits to cap * tanh(logits / cap).

    The vocabulary is split over the tensor-parallel ranks (engine/layers/linear.py), embedding and
    head alike, rather than replicated: the head is the largest matrix of a small model (SmolLM2:
    28M of 135M parameters), and a tied head shares the embedding's shard."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: Sequence[nn.Module],
        norm: nn.Module,
        embed_scale: float | None = None,
        logit_softcap: float | None = None,
        parallel: ParallelState = SINGLE,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg, layers, norm, parallel)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embed_scale, self.logit_softcap = embed_scale, logit_softcap

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:  # HF rounds the scale to the weights' dtype first
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden]
        x = self.embed(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, positions, kv_cache, meta)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()  # [N, vocab]
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


def single_rank_only(cfg: ModelConfig, tp_size: int, why: str) -> None:
    """Refuse, naming the flag, a family this engine does not split over ranks."""
    if tp_size > 1:
        raise ValueError(
            f"{cfg.architecture} runs on one rank only ({why}): "
            f"--tensor-parallel-size {tp_size} is refused; use 1"
        )


@dataclasses.dataclass(frozen=True)
class RankHeads:
    """The heads one tensor-parallel rank computes: its query heads, its KV heads, and on how
    many ranks each of those KV heads is (more than one when the ranks outnumber them)."""

    query: range
    kv: range
    kv_replicas: int

    @classmethod
    def of(cls, cfg: ModelConfig, parallel: ParallelState) -> RankHeads:
        tp, rank = parallel.tp_size, parallel.rank
        query = query_heads_of(cfg.num_heads, cfg.num_kv_heads, tp, rank)
        return cls(query, kv_heads_of(cfg.num_kv_heads, tp, rank), max(1, tp // cfg.num_kv_heads))


def rotary(cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
    """The model's rotary embedding; ``partial_rotary_factor`` rotates only the first channels."""
    rope = cfg.rope_parameters()
    rotary_dim = int(cfg.head_dim * rope.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(rotary_dim, max_positions, rope, cfg.max_position_embeddings)


def attention_spec(cfg: ModelConfig, layer: int, **variant) -> AttentionSpec:
    """Layer ``layer``'s attention: the model's shape and window, plus the family's ``variant`` fields."""
    fields = dict(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        scale=cfg.head_dim**-0.5,
        sliding_window=cfg.sliding_window(layer),
    )
    return AttentionSpec(**{**fields, **variant})
