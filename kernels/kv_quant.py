"""KV int8 quantization with one scale per (block, kv head), for a compressed cache or transfer.

    x: [n, block_size, num_kv_heads, head_dim] float
    scale[b, h] = max |x[b, :, h, :]| / 127
    q = clamp(floor(x * (127 / max) + 0.5), -127, 127)        (round half up; all-zero -> 0)
    dequantized = q * scale        error per element <= scale / 2 (plus float rounding)

One program per (block, head) tile of [block_size, head_dim]; the math is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import FLOAT_DTYPES, next_power_of_2


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, scales_ptr, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, TOK_PAD: tl.constexpr, DIM_PAD: tl.constexpr):  # fmt: skip
    block = tl.program_id(0)
    head = tl.program_id(1)
    t = tl.arange(0, TOK_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (t < BLOCK_SIZE)[:, None] & (d < HEAD_DIM)[None, :]
    row = NUM_KV_HEADS * HEAD_DIM  # elements per token
    offs = block.to(tl.int64) * BLOCK_SIZE * row + t[:, None] * row + head * HEAD_DIM + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    # div_rn: IEEE round-to-nearest division, as on the CPU (compiled "/" may approximate), so the
    # compiled and interpreted scales agree bit for bit; no 1/0 on all-zero tiles
    inv = tl.where(amax > 0, tl.div_rn(127.0, tl.where(amax > 0, amax, 1.0)), 0.0)
    q = tl.minimum(tl.maximum(tl.floor(x * inv + 0.5), -127.0), 127.0)
    tl.store(q_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scales_ptr + block * NUM_KV_HEADS + head, tl.div_rn(amax, 127.0))


@triton.jit
def _dequantize_kernel(q_ptr, scales_ptr, out_ptr, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                       HEAD_DIM: tl.constexpr, TOK_PAD: tl.constexpr, DIM_PAD: tl.constexpr):  # fmt: skip
    block = tl.program_id(0)
    head = tl.program_id(1)
    t = tl.arange(0, TOK_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (t < BLOCK_SIZE)[:, None] & (d < HEAD_DIM)[None, :]
    row = NUM_KV_HEADS * HEAD_DIM  # elements per token
    offs = block.to(tl.int64) * BLOCK_SIZE * row + t[:, None] * row + head * HEAD_DIM + d[None, :]
    scale = tl.load(scales_ptr + block * NUM_KV_HEADS + head)
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + offs, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _meta(shape: torch.Size) -> dict[str, int]:
    _, block_size, num_kv_heads, head_dim = shape
    return dict(BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                TOK_PAD=next_power_of_2(block_size), DIM_PAD=next_power_of_2(head_dim))  # fmt: skip


def quantize_kv_int8_triton(
    x: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, block_size, kv_heads, head_dim] float -> (q int8 like x, scales fp32 [n, kv_heads])."""
    assert x.dim() == 4 and x.is_contiguous(), (x.shape, x.stride())
    assert x.dtype in FLOAT_DTYPES, x.dtype
    if out is None:
        out = (
            x.new_empty(x.shape, dtype=torch.int8),
            x.new_empty((x.shape[0], x.shape[2]), dtype=torch.float32),
        )
    q, scales = out
    assert q.shape == x.shape and q.dtype == torch.int8 and q.is_contiguous(), (q.shape, q.dtype)
    assert scales.shape == (x.shape[0], x.shape[2]) and scales.dtype == torch.float32, scales.shape
    assert scales.is_contiguous(), scales.stride()
    if x.numel() > 0:
        _quantize_kernel[(x.shape[0], x.shape[2])](x, q, scales, **_meta(x.shape))
    return q, scales


def dequantize_kv_int8_triton(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of ``quantize_kv_int8_triton``: q * scale, as ``dtype``."""
    assert q.dim() == 4 and q.is_contiguous() and q.dtype == torch.int8, (q.shape, q.dtype)
    assert scales.shape == (q.shape[0], q.shape[2]), (scales.shape, q.shape)
    assert scales.dtype == torch.float32, scales.dtype
    assert scales.is_contiguous() and scales.device == q.device, (scales.stride(), scales.device)
    assert dtype in FLOAT_DTYPES, dtype
    out = q.new_empty(q.shape, dtype=dtype) if out is None else out
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous(), (out.shape, out.dtype)
    if q.numel() > 0:
        _dequantize_kernel[(q.shape[0], q.shape[2])](q, scales, out, **_meta(q.shape))
    return out


def quantize_kv_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: one (block, head) tile at a time, same fp32 operations as the kernel."""
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty((x.shape[0], x.shape[2]), dtype=torch.float32)
    for b in range(x.shape[0]):
        for h in range(x.shape[2]):
            tile = x[b, :, h, :].float().cpu()
            amax = tile.abs().max()
            inv = 127.0 / amax if amax > 0 else torch.tensor(0.0)
            q[b, :, h, :] = torch.floor(tile * inv + 0.5).clamp(-127, 127).to(torch.int8)
            scales[b, h] = amax / 127.0
    return q.to(x.device), scales.to(x.device)


def dequantize_kv_int8_ref(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reference: one (block, head) tile at a time."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            out[b, :, h, :] = (q[b, :, h, :].float() * scales[b, h]).to(dtype)
    return out
