"""GPT-2: learned position embeddings, LayerNorm, multi-head attention (no GQA, no rotation),
GELU MLP, and Conv1D weights stored [in, out]. The module tree keeps HF's names
(``transformer.h.<i>.attn.c_attn``) so checkpoints load without renaming."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import ModelConfig
from pdserve.engine.layers.activations import activation
from pdserve.engine.layers.attention import AttentionSpec, KVCache, attend, split_heads


class Conv1D(nn.Module):
    """A linear layer whose weight is [in, out] (GPT-2's layout): x @ weight + bias."""

    def __init__(self, num_in: int, num_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_in, num_out))
        self.bias = nn.Parameter(torch.zeros(num_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)  # [T, in] -> [T, out]


class GPT2Attention(nn.Module):
    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.c_attn = Conv1D(spec.hidden_size, 3 * spec.hidden_size)  # q, k, v side by side
        self.c_proj = Conv1D(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = split_heads(self.c_attn(x), self.spec)  # [T, H, D] each
        return self.c_proj(attend(q, k, v, kv_cache, meta, self.spec).reshape(x.shape[0], -1))


class GPT2MLP(nn.Module):
    def __init__(self, hidden_size: int, inner_size: int, act: str) -> None:
        super().__init__()
        self.c_fc, self.c_proj, self.act = (
            Conv1D(hidden_size, inner_size),
            Conv1D(inner_size, hidden_size),
            activation(act),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        hf, width = cfg.hf, cfg.hidden_size
        scale = cfg.head_dim**-0.5 if hf.scale_attn_weights else 1.0
        if hf.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        spec = AttentionSpec(
            width, cfg.num_heads, cfg.num_heads, cfg.head_dim, scale, qkv_bias=True, o_bias=True
        )
        self.ln_1, self.attn = nn.LayerNorm(width, eps=hf.layer_norm_epsilon), GPT2Attention(spec)
        self.ln_2 = nn.LayerNorm(width, eps=hf.layer_norm_epsilon)
        self.mlp = GPT2MLP(width, hf.n_inner or 4 * width, hf.activation_function)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.hf.layer_norm_epsilon)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        if max_positions > cfg.max_position_embeddings:
            raise ValueError(
                f"GPT-2 has {cfg.max_position_embeddings} learned positions; "
                f"max_model_len {max_positions} exceeds them"
            )
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
