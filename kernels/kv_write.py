"""KV-cache write: scatter new tokens' K/V into their cache slots (the write half of PagedAttention).

    slot = block_id * block_size + offset_in_block        (protocol/kv_layout.py)
    key[t] ──► key_cache[slot // block_size, slot % block_size]   for each new token t

One program per token copies its [num_kv_heads, head_dim] rows of K and of V, casting to
the cache dtype. Slots must be valid: nothing checks them on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import FLOAT_DTYPES, check_cache_pair, check_index_tensor, next_power_of_2


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # a padded row (a CUDA graph's batch is padded to its captured size) writes nothing
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :]  # contiguous cache
    k = tl.load(key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton KV write; arguments as ``ops.write_kv_cache``. key/value may be strided views."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _, _, cache_heads, _ = check_cache_pair(key_cache, value_cache, head_dim)
    assert cache_heads == num_kv_heads, (key.shape, key_cache.shape)
    assert value.shape == key.shape, (key.shape, value.shape)
    for name, t in (("key", key), ("value", value)):
        assert t.dtype in FLOAT_DTYPES, f"{name} dtype {t.dtype}"
        assert t.stride(2) == 1, f"{name}'s head_dim must be contiguous"
        assert t.device == key_cache.device, (t.device, key_cache.device)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    check_index_tensor(slot_mapping, "slot_mapping", key_cache.device)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=next_power_of_2(num_kv_heads), DIM_PAD=next_power_of_2(head_dim),
    )  # fmt: skip


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference: one token at a time; slot -1 (a padded row) writes nothing."""
    block_size = key_cache.shape[1]
    for t in range(key.shape[0]):
        if int(slot_mapping[t]) < 0:
            continue
        block, offset = divmod(int(slot_mapping[t]), block_size)
        key_cache[block, offset] = key[t].to(key_cache.dtype)
        value_cache[block, offset] = value[t].to(value_cache.dtype)
