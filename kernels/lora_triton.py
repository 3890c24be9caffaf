"""Batched LoRA for a step whose rows use different adapters (punica's BGMV, after vLLM's
lora/ops): each row picks its adapter's A and B out of the stacked slots.

    shrink:  h[t] = A[slot[t]] @ x[t]          x: [T, in]   A: [S, R, in]   h: [T, R]
    expand:  y[t] += B[slot[t]] @ h[t]         h: [T, R]    B: [S, N, R]    y: [T, N]

``slot[t] == S`` (one past the last slot) is a base-model row: shrink writes zeros for it and
expand leaves its y untouched. One program per (row, tile of outputs): a row's A or B tile is
a small GEMV, summed in fp32. y and h may be column slices of wider tensors (a merged layer's
parts): their rows are strided, their columns contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import FLOAT_DTYPES, check_index_tensor, next_power_of_2

BLOCK_R = 16  # shrink: ranks per program
BLOCK_K = 128  # shrink: input features per loop step
BLOCK_N = 64  # expand: outputs per program


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, slots_ptr, h_ptr,
    stride_x, stride_a_slot, stride_a_row, stride_h,
    IN, R, NUM_SLOTS,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < R
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot < NUM_SLOTS:
        for k0 in range(0, IN, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < IN
            xv = tl.load(x_ptr + tok * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
            av = tl.load(
                a_ptr + slot * stride_a_slot + r[:, None] * stride_a_row + k[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(h_ptr + tok * stride_h + r, acc.to(h_ptr.dtype.element_ty), mask=r_mask)


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, slots_ptr, y_ptr,
    stride_h, stride_b_slot, stride_b_row, stride_y,
    N, R, NUM_SLOTS,
    BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if slot >= NUM_SLOTS:  # a base-model row: no adapter adds anything
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    r = tl.arange(0, R_PAD)
    r_mask = r < R
    hv = tl.load(h_ptr + tok * stride_h + r, mask=r_mask, other=0.0).to(tl.float32)
    bv = tl.load(
        b_ptr + slot * stride_b_slot + n[:, None] * stride_b_row + r[None, :],
        mask=n_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(bv * hv[None, :], axis=1)  # [BLOCK_N]
    yv = tl.load(y_ptr + tok * stride_y + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + tok * stride_y + n, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def _check(rows: torch.Tensor, stacked: torch.Tensor, token_slots: torch.Tensor, what: str) -> None:
    assert rows.dim() == 2 and stacked.dim() == 3, (what, rows.shape, stacked.shape)
    assert rows.dtype in FLOAT_DTYPES and stacked.dtype in FLOAT_DTYPES, (what, rows.dtype, stacked.dtype)
    assert rows.stride(1) == 1, f"{what}: its columns must be contiguous"
    assert stacked.stride(2) == 1, f"{what}: the stacked weights' last dim must be contiguous"
    assert token_slots.shape == rows.shape[:1], (what, token_slots.shape, rows.shape)
    assert stacked.device == rows.device, (what, stacked.device, rows.device)
    check_index_tensor(token_slots, "token_slots", rows.device)


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, h: torch.Tensor) -> None:
    """h [T, R] = each row's A [R, in] @ x[t]; zeros on base rows (slot == S)."""
    _check(x, a, token_slots, "shrink x")
    assert h.shape == (x.shape[0], a.shape[1]) and h.stride(1) == 1, (h.shape, x.shape, a.shape)
    assert a.shape[2] == x.shape[1], (x.shape, a.shape)
    num_tokens, rank = h.shape
    if num_tokens == 0:
        return
    _shrink_kernel[(num_tokens, triton.cdiv(rank, BLOCK_R))](
        x, a, token_slots, h,
        x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        x.shape[1], rank, a.shape[0],
        BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def lora_expand_triton(h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor) -> None:
    """y [T, N] += each row's B [N, R] @ h[t], in place; base rows (slot == S) untouched."""
    _check(h, b, token_slots, "expand h")
    _check(y, b, token_slots, "expand y")
    assert b.shape[1:] == (y.shape[1], h.shape[1]), (h.shape, b.shape, y.shape)
    num_tokens, n = y.shape
    if num_tokens == 0 or n == 0:
        return
    _expand_kernel[(num_tokens, triton.cdiv(n, BLOCK_N))](
        h, b, token_slots, y,
        h.stride(0), b.stride(0), b.stride(1), y.stride(0),
        n, h.shape[1], b.shape[0],
        BLOCK_N=BLOCK_N, R_PAD=next_power_of_2(h.shape[1]),
    )  # fmt: skip


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """Reference: one row at a time, in fp32. -> h [T, R] in x's dtype, zeros on base rows."""
    h = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < a.shape[0]:
            h[t] = (a[slot].float() @ x[t].float()).to(x.dtype)
    return h


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor) -> None:
    """Reference: y[t] += B[slot[t]] @ h[t] one row at a time, in fp32; base rows untouched."""
    for t, slot in enumerate(token_slots.tolist()):
        if slot < b.shape[0]:
            y[t] = (y[t].float() + b[slot].float() @ h[t].float()).to(y.dtype)
