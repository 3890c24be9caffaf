"""GPT-2: learned position embeddings, LayerNorm, multi-head attention (no GQA, no rotation),
GELU MLP, and Conv1D weights stored [in, out] (read transposed by the loaders). The module tree
keeps HF's names (``transformer.h.<i>.attn.c_attn``) so checkpoints load without renaming."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.attention import AttentionMetadata
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.activations import activation
from pdserve.engine.layers.attention import AttentionSpec, KVCache, attend, split_heads
from pdserve.engine.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)


class GPT2Attention(nn.Module):
    """Multi-head attention with q, k and v side by side in ``c_attn`` (this rank's heads of each
    under tensor parallelism) and ``c_proj`` summing the ranks' outputs."""

    def __init__(self, spec: AttentionSpec, parallel: ParallelState) -> None:
        super().__init__()
        width, d = spec.hidden_size, spec.head_dim
        self.c_attn = QKVParallelLinear(width, d, spec.num_heads, spec.num_heads, parallel, bias=True)
        local = self.c_attn.num_heads
        self.spec = dataclasses.replace(spec, num_heads=local, num_kv_heads=local)
        q = self.c_attn.q_heads
        self.c_proj = RowParallelLinear(
            width, width, parallel, bias=True, columns=range(q.start * d, q.stop * d)
        )

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = split_heads(self.c_attn(x), self.spec)  # [T, H, D] each
        return self.c_proj(attend(q, k, v, kv_cache, meta, self.spec).reshape(x.shape[0], -1))


class GPT2MLP(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int, act: str, parallel: ParallelState) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(hidden_size, inner_size, parallel, bias=True)
        self.c_proj = RowParallelLinear(inner_size, hidden_size, parallel, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelState) -> None:
        super().__init__()
        hf, width = cfg.hf, cfg.hidden_size
        scale = cfg.head_dim**-0.5 if hf.scale_attn_weights else 1.0
        if hf.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        spec = AttentionSpec(
            width, cfg.num_heads, cfg.num_heads, cfg.head_dim, scale, qkv_bias=True, o_bias=True
        )
        self.ln_1, self.attn = nn.LayerNorm(width, eps=hf.layer_norm_epsilon), GPT2Attention(spec, parallel)
        self.ln_2 = nn.LayerNorm(width, eps=hf.layer_norm_epsilon)
        self.mlp = GPT2MLP(width, hf.n_inner or 4 * width, hf.activation_function, parallel)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)  # on every rank
        self.h = nn.ModuleList(GPT2Block(cfg, i, parallel) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.hf.layer_norm_epsilon)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, parallel: ParallelState = SINGLE) -> None:
        super().__init__()
        if max_positions > cfg.max_position_embeddings:
            raise ValueError(
                f"GPT-2 has {cfg.max_position_embeddings} learned positions; "
                f"max_model_len {max_positions} exceeds them"
            )
        self.config = cfg
        self.transformer = GPT2Model(cfg, parallel)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden]
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block, kv_cache in zip(self.transformer.h, kv_caches, strict=True):
            x = block(x, kv_cache, meta)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [N, vocab]

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """OpenAI's checkpoints name tensors without the ``transformer.`` prefix and store the causal
        mask as ``attn.bias`` / ``attn.masked_bias`` buffers, which are skipped."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] == "attn" and parts[-1] in ("bias", "masked_bias"):
            return None
        return name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name

    @staticmethod
    def checkpoint_transposed(name: str) -> bool:
        """Conv1D matrices are stored [in, out]; the loaders read them as [out, in]."""
        return name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))
