"""Fast pure-torch paths for the paged-KV operations, used on CPU tensors.

They take the same arguments as the Triton kernels (see ``kernels/ops.py``) and read
the cache in the layout of ``protocol/kv_layout.py``: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import kv_int8


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens]; slot -1: a
    # padded row (a CUDA graph's batch of fixed size), written nowhere
    num_kv_heads, width = key_cache.shape[2], key_cache.shape[3]
    slots = slot_mapping.long()
    if slots.numel() and bool(slots.min() < 0):  # a host sync: this reference path is never graphed
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if kv_int8.is_int8(key_cache):  # rows of head_dim int8 values and their scale (nbhd-q8-v1)
        key, value = kv_int8.quantize_rows(key), kv_int8.quantize_rows(value)
    key_cache.view(-1, num_kv_heads, width).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, width).index_copy_(0, slots, value.to(value_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    # -> [context_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    if kv_int8.is_int8(cache):  # int8 rows (nbhd-q8-v1): their values in fp32
        blocks = kv_int8.dequantize_rows(blocks)
    return blocks.reshape(-1, blocks.shape[2], blocks.shape[3])[:context_len]


def _causal_bias(
    first_pos: int,
    q_len: int,
    context_len: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    # [Q, T] additive mask: query at position p sees keys k with p - window < k <= p
    q_pos = torch.arange(first_pos, first_pos + q_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    hidden = k_pos > q_pos
    if sliding_window is not None:
        hidden |= k_pos <= q_pos - sliding_window
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    # q: [..., Q, D]; k, v: [..., T, D]; mask: additive, broadcastable to [..., Q, T]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # SDPA has no soft-capping: capped logits, then the mask, then softmax in fp32 (as HF's eager path).
    scores = torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap) * softcap + mask  # [..., Q, T]
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context.

    query: [num_tokens, num_heads, head_dim], the new tokens of all sequences back to back;
    sequence i owns query rows query_start_loc[i]:query_start_loc[i+1], which are its last
    positions, context_lens[i] - q_len .. context_lens[i] - 1 (their K/V already written).
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    num_heads = query.shape[1]
    for i, context_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _gather_context(key_cache, block_tables[i], context_len)  # [T, KVH, D]
        v = _gather_context(value_cache, block_tables[i], context_len)
        # 4-D [1, H, ., D]: CPU SDPA runs its fused flash kernel only on 4-D inputs (3-D falls back
        # to the unfused math path, ~6x slower at 1.5k tokens).
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        groups = num_heads // k.shape[1]
        k = k.transpose(0, 1).repeat_interleave(groups, dim=0).to(q.dtype).unsqueeze(0)  # [1, H, T, D]
        v = v.transpose(0, 1).repeat_interleave(groups, dim=0).to(q.dtype).unsqueeze(0)
        if q_len == context_len and sliding_window is None and softcap is None:
            # Plain causal: no mask tensor to build or read.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            mask = _causal_bias(context_len - q_len, q_len, context_len, sliding_window, q.dtype, q.device)
            o = _attention(q, k, v, mask, scale, softcap)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence (the last of its context), batched with padding.

    query: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks_per_seq]
    (entries past a sequence's blocks may hold any valid block id); context_lens: [num_seqs].
    Sequences of similar length are batched together, so padding stays a small fraction of
    the K/V that is gathered (on CPU the gather copy is most of the cost).
    """
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return torch.empty_like(query)
    out = torch.empty_like(query)
    lens = context_lens.tolist()
    for group in _length_buckets(lens):
        idx = torch.tensor(group, dtype=torch.int64, device=query.device)
        out[idx] = _decode_padded(
            query[idx],
            key_cache,
            value_cache,
            block_tables[idx],
            context_lens[idx],
            scale,
            sliding_window,
            softcap,
        )
    return out


def _length_buckets(lens: list[int], max_waste: float = 0.25) -> list[list[int]]:
    """Indices grouped by length so that padded size <= (1 + max_waste) * real size per group."""
    order = sorted(range(len(lens)), key=lens.__getitem__, reverse=True)
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if (
            groups
            and len(groups[-1])
            and (len(groups[-1]) + 1) * lens[groups[-1][0]] <= (1 + max_waste) * (total + lens[i])
        ):
            groups[-1].append(i)
            total += lens[i]
        else:
            groups.append([i])
            total = lens[i]
    return groups


def _decode_padded(query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window, softcap):
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(context_lens.max())
    max_blocks = (max_len + block_size - 1) // block_size
    # [S, max_blocks, bs, KVH, D] -> [S, KVH, T, D]. index_select on the flat table is ~3x faster
    # than advanced indexing here; SDPA takes the transposed (strided) view without a copy.
    flat = block_tables[:, :max_blocks].reshape(-1).long()
    k, v = key_cache.index_select(0, flat), value_cache.index_select(0, flat)
    if kv_int8.is_int8(key_cache):  # int8 rows (nbhd-q8-v1): their values in fp32
        k, v = kv_int8.dequantize_rows(k), kv_int8.dequantize_rows(v)
    k = k.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    groups = num_heads // num_kv_heads
    q = query.reshape(num_seqs, num_kv_heads, groups, head_dim)  # [S, KVH, G, D]
    k_pos = torch.arange(k.shape[2], device=k.device).unsqueeze(0)  # [1, T]
    lens = context_lens.long().unsqueeze(1)  # [S, 1]
    hidden = k_pos >= lens
    if sliding_window is not None:
        hidden |= k_pos < lens - sliding_window
    # An additive float mask is about twice as fast as a boolean one in CPU SDPA.
    mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
    mask = mask[:, None, None, :]
    o = _attention(q, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap)
    return o.reshape(num_seqs, num_heads, head_dim)


def gather_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_ids: torch.Tensor
) -> torch.Tensor:
    # -> [num_layers, 2, n, block_size, num_kv_heads, head_dim]
    ids = block_ids.long()
    buffer = key_caches[0].new_empty((len(key_caches), 2, ids.shape[0], *key_caches[0].shape[1:]))
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        torch.index_select(k, 0, ids, out=buffer[layer, 0])
        torch.index_select(v, 0, ids, out=buffer[layer, 1])
    return buffer


def scatter_blocks(
    buffer: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
) -> None:
    ids = block_ids.long()
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        k.index_copy_(0, ids, buffer[layer, 0])
        v.index_copy_(0, ids, buffer[layer, 1])


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [n, block_size, num_kv_heads, head_dim] -> q like x (int8), scales [n, num_kv_heads] fp32
    xf = x.float()
    amax = xf.abs().amax(dim=(1, 3))  # [n, KVH]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.floor(xf * inv[:, None, :, None] + 0.5).clamp_(-127, 127).to(torch.int8)
    return q, amax / 127.0


def dequantize_kv_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scales[:, None, :, None]).to(dtype)
