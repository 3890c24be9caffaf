"""Normalisations: RMSNorm in Llama's form (w * x) and Gemma's form ((1 + w) * x), and LayerNorm."""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.layers.linear import CheckpointTensor, as_checkpoint
from pdserve.kernels import cpu_ext

LayerNorm = nn.LayerNorm  # GPT-2 and StableLM: mean and variance, weight and bias


class RMSNorm(nn.Module):
    """x / rms(x), scaled by ``weight`` (Llama) or by ``1 + weight`` (Gemma, zero-initialised).

    Works on any leading shape: [T, hidden], or [T, heads, head_dim] for per-head q/k norms.
    The rounding follows HF per family: Llama casts back to the input dtype before scaling,
    Gemma scales in fp32 and casts after.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and cpu_ext.enabled():  # one pass (kernels/csrc/dense_cpu.cpp)
            flat = x.reshape(-1, x.shape[-1])  # a view where it can be (2-D, or packed heads)
            flat = flat if flat.stride(-1) == 1 else flat.contiguous()
            return cpu_ext.rms_norm(flat, self.weight, self.eps, self.unit_offset).view(x.shape)
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(dtype)
        return self.weight * normed.to(dtype)

    def add_and_norm_(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` (in place), then this norm of the sum: the pre-norm layer's
        "x = x + attn(...); mlp(norm(x))" with one pass over memory where the CPU kernel runs."""
        if x.device.type == "cpu" and x.dim() == 2 and residual.is_contiguous() and cpu_ext.enabled():
            return cpu_ext.add_rms_norm_(x, residual, self.weight, self.eps, self.unit_offset)
        residual.add_(x)
        return self(residual)


class FlatHeadsRMSNorm(RMSNorm):
    """RMSNorm over all of a token's heads at once (OLMo 2's q/k norm): [T, heads, D] is
    normalised as [T, heads * D], with one weight of heads * D channels.

    Under tensor parallelism a rank holds ``heads`` of the model's ``num_heads``: its weight is
    their channels, and the sum of squares is summed over the ranks, a head that ``replicas``
    ranks hold (more ranks than KV heads) counted once."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        eps: float,
        heads: range | None = None,
        replicas: int = 1,
        parallel: ParallelState = SINGLE,
    ) -> None:
        heads = range(num_heads) if heads is None else heads
        super().__init__(len(heads) * head_dim, eps)
        self.channels, self.first = num_heads * head_dim, heads.start * head_dim
        self.replicas, self.parallel = replicas, parallel
        self.weight.weight_loader = self.load_channels  # type: ignore[attr-defined]

    def load_channels(self, param: torch.Tensor, full: CheckpointTensor, shard: object = None) -> None:
        with torch.no_grad():
            param.copy_(as_checkpoint(full).narrow(0, self.first, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(x.shape[0], -1)  # [T, heads * D]
        if self.parallel.tp_size == 1:
            return super().forward(flat).view_as(x)
        squares = flat.float().pow(2).sum(-1, keepdim=True) / self.replicas
        self.parallel.all_reduce(squares)
        normed = flat.float() * torch.rsqrt(squares / self.channels + self.eps)
        return (self.weight * normed.to(x.dtype)).view_as(x)


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm (no bias) of its own for each head (StableLM's qk_layernorm): [T, heads, D].
    Every head's norm is kept (a few channels each, loaded by name); a tensor-parallel rank
    applies those of its ``heads``."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, heads: range | None = None) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(head_dim, eps=eps, bias=False) for _ in range(num_heads))
        self.heads = range(num_heads) if heads is None else heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, len(heads), D]
        return torch.stack([self.norms[h](x[:, i]) for i, h in enumerate(self.heads)], dim=1)
