"""Paged prefill / chunked-prefill attention: varlen, causal, over cache prefix + new tokens.

The new tokens of every sequence sit back to back in ``query``; their K/V are already in
the cache (``write_kv_cache`` runs first). Sequence i's rows are its LAST q_len positions:

    context_len = 10, q_len = 3 (a chunk after a 7-token prefix hit / earlier chunk)
    positions:  0 1 2 3 4 5 6 | 7 8 9
                cached prefix   new rows -> query[q_start : q_start + 3]
    row at position p sees keys k with  p - window < k <= p  (window = infinity if None)

One program per (sequence, query head, tile of BLOCK_M rows); keys stream in tiles of
BLOCK_N tokens gathered through the block table, with an online softmax.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import check_cache_pair, check_index_tensor, next_power_of_2

_NO_WINDOW = 1 << 30  # wider than any context
_LOG2E = 1.4426950408889634

# Shared memory per block on an H100 (sm_90): 227 KB. Triton also stages layout conversions and
# reductions there; 16 KB is left to them.
SMEM_BYTES = 227 * 1024
SMEM_BUDGET = SMEM_BYTES - 16 * 1024


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillTiles:
    block_m: int  # query rows per program
    block_n: int  # keys per loop iteration
    num_stages: int  # K/V tiles Triton's pipeliner keeps in shared memory at once

    def smem_bytes(self, head_dim_pad: int, q_bytes: int, kv_bytes: int) -> int:
        """Shared memory the tiles take: the query tile, an operand of both dots for the whole
        loop, plus ``num_stages`` buffers of a K and a V tile each.

            bf16, head_dim 256, 64 x 64, 3 stages:  64*256*2 + 3 * 2 * 64*256*2 = 32 + 192 = 224 KB  (> 211: too many)
                                             2 stages:                             32 + 128 = 160 KB
            fp32, head_dim 128, 64 x 64, 3 stages:  64*128*4 + 3 * 2 * 64*128*4 = 32 + 192 = 224 KB  (> 211)
                                             2 stages:                             32 + 128 = 160 KB
            fp32, head_dim 256, 64 x 64, 1 stage:   64*256*4 + 1 * 2 * 64*256*4 = 64 + 128 = 192 KB
            bf16, head_dim 128, 64 x 64, 3 stages:  64*128*2 + 3 * 2 * 64*128*2 = 16 +  96 = 112 KB
        """
        q_tile = self.block_m * head_dim_pad * q_bytes
        kv_tiles = self.num_stages * 2 * self.block_n * head_dim_pad * kv_bytes
        return q_tile + kv_tiles


def prefill_tiles(
    head_dim: int, q_bytes: int, kv_bytes: int, block_m: int = 64, block_n: int = 64
) -> PrefillTiles:
    """The most pipeline stages (3, Triton's default, down to 1) whose tiles fit SMEM_BUDGET, then
    narrower key tiles where even one stage does not fit (every supported family fits at 64 x 64:
    tests/test_kernels_triton.py)."""
    pad = max(16, next_power_of_2(head_dim))
    while True:
        for stages in (3, 2, 1):
            tiles = PrefillTiles(block_m, block_n, stages)
            if tiles.smem_bytes(pad, q_bytes, kv_bytes) <= SMEM_BUDGET:
                return tiles
        if block_n == 16 and block_m == 16:
            return tiles  # nothing smaller: let Triton say it does not fit
        block_n, block_m = (block_n // 2, block_m) if block_n > 16 else (block_n, block_m // 2)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    scale_log2, window, cap_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt_seq,
    stride_c_block, stride_c_tok, stride_c_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if tile * BLOCK_M >= q_len:
        return
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M], index among the new tokens
    r_mask = rows < q_len
    pos = ctx - q_len + rows  # [M], position in the context
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    rd_mask = r_mask[:, None] & d_mask[None, :]
    q_offs = (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=rd_mask, other=0.0)

    first_pos = ctx - q_len + tile * BLOCK_M
    lo = tl.maximum(0, first_pos - window + 1)
    hi = tl.minimum(ctx, first_pos + BLOCK_M)  # one past the last position this tile needs
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [N]
        k_valid = keys < hi
        bt_offs = seq * stride_bt_seq + keys // BLOCK_SIZE
        block = tl.load(block_tables_ptr + bt_offs, mask=k_valid, other=0).to(tl.int64)
        row = block * stride_c_block + (keys % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = k_valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [M, N], no tf32 for fp32
        if HAS_SOFTCAP:  # cap * tanh(s / cap), in the log2 domain (cap_log2 = cap * log2(e))
            s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / cap_log2) + 1.0))
        visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window) & k_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        # A row may see nothing in this tile (window, or padding rows): keep it NaN-free.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (q_start + rows)[:, None] * stride_o_tok + head * stride_o_head + d[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=rd_mask)


def paged_prefill_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged prefill attention; arguments as ``ops.paged_prefill_attention``.

    K/V tiles are cast to the query dtype before the dot products (as the torch path does);
    ``out`` (like query) to write into. The pipeline's stages (and, where needed, the key tile)
    come from ``prefill_tiles``, so that the tiles fit in shared memory.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = check_cache_pair(key_cache, value_cache, head_dim)
    assert query.dtype in (torch.float32, torch.float16, torch.bfloat16), query.dtype
    assert query.stride(2) == 1, "query's head_dim must be contiguous"
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    num_seqs = context_lens.shape[0]
    assert context_lens.shape == (num_seqs,), context_lens.shape
    assert query_start_loc.shape == (num_seqs + 1,), (query_start_loc.shape, num_seqs)
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, block_tables.shape
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens)):  # fmt: skip
        check_index_tensor(t, name, query.device)
    assert sliding_window is None or sliding_window > 0, sliding_window
    assert softcap is None or softcap > 0, softcap
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        assert size >= 16 and size & (size - 1) == 0, f"{name} must be a power of two >= 16, got {size}"
    tiles = prefill_tiles(head_dim, query.element_size(), key_cache.element_size(), block_m, block_n)
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1, out.shape
    if num_seqs == 0 or num_tokens == 0:
        return out
    if query_start_loc.is_cuda:  # no host sync: bound the longest sequence by the batch
        max_q_len = num_tokens
    else:
        max_q_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    window = _NO_WINDOW if sliding_window is None else sliding_window
    grid = (num_seqs, num_heads, triton.cdiv(max(max_q_len, 1), tiles.block_m))
    _prefill_kernel[grid](
        query, key_cache, value_cache, out, block_tables, query_start_loc, context_lens,
        scale * _LOG2E, window, (softcap or 1.0) * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=block_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, next_power_of_2(head_dim)), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        HAS_SOFTCAP=softcap is not None, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


def paged_prefill_attention_ref(
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
    """Reference: row by row in float64 over the visible keys only, every head of a row at once (the
    keys gathered slot by slot from the block table, each query head reading its group's KV head)."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    for seq in range(context_lens.shape[0]):
        context_len = int(context_lens[seq])
        q_start, q_end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        positions = torch.arange(context_len, device=block_tables.device)
        blocks = block_tables[seq, positions // block_size].long()
        offsets = positions % block_size
        keys = key_cache[blocks, offsets].double().repeat_interleave(group, dim=1)  # [context, H, D]
        values = value_cache[blocks, offsets].double().repeat_interleave(group, dim=1)
        for i, row in enumerate(range(q_start, q_end)):
            pos = context_len - (q_end - q_start) + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            k, v = keys[first : pos + 1], values[first : pos + 1]  # [T, H, D]
            logits = torch.einsum("thd,hd->ht", k, query[row].double()) * scale  # [H, T]
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            weights = torch.softmax(logits, dim=-1)
            out[row] = torch.einsum("ht,thd->hd", weights, v).to(out.dtype)
    return out
