"""The int8 KV cache in memory: layout ``nbhd-q8-v1`` (protocol/kv_layout.py), pure torch.

Each (token, KV head) row of D values is stored as D int8 values followed by its fp32 scale's
four bytes, so one layer's cache is an int8 tensor

    [num_blocks, block_size, num_kv_heads, head_dim + 4]

and a block's scales live inside the block: copy-on-write, swaps, the shared host pool and the
KV transfer move a block's bytes and carry its scales with them, with no second tensor to keep
in step. Rows are quantized alone when written,

    scale = max |x| / 127         q = clamp(round(x / scale), -127, 127)     (all zero: 0, 0)
    x ~ q * scale                 |error| <= scale / 2 per value

so a block's earlier rows never change when later ones arrive: a speculative draft that is
rolled back leaves the rows before it exactly as they were, and a full block reads the same on
every node that holds it. The CPU attention kernel (kernels/csrc) reads this layout directly.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale after each row's head_dim int8 values


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def head_dim_of(cache: torch.Tensor) -> int:
    """The model's head_dim for a cache in either layout."""
    return cache.shape[-1] - SCALE_BYTES if is_int8(cache) else cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8 rows, each with its scale's bytes last."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = amax / 127.0
    q = torch.where(amax > 0, xf / torch.where(amax > 0, scale, 1.0), 0.0).round_().clamp_(-127, 127)
    out = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8, device=x.device)
    out[..., : x.shape[-1]] = q.to(torch.int8)
    out[..., x.shape[-1] :] = scale.contiguous().view(torch.int8)
    return out


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] values as ``dtype`` (q * scale in fp32, then cast)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)
