"""Paged decode attention: one query token per sequence over its paged KV context.

Flash-decoding: the context is cut into partitions of ``partition_size`` tokens; each
(sequence, kv head, partition) is one program that writes a partial softmax (running max,
sum of exponentials, unnormalised output), and a second kernel merges the partitions. So a
batch of one long sequence still spreads over many programs.

    context_len = 11, partition_size = 4, block_size = 4, block_table = [7, 2, 9]
    tokens:     0 1 2 3 | 4 5 6 7 | 8 9 10
    blocks:     [  7  ]   [  2  ]   [ 9 ..]
    programs:   part 0    part 1    part 2     -> reduce -> out[seq, head]

A program serves all query heads of one kv head (GQA), so each K/V row is read once.
Tokens are gathered one row at a time (block id looked up per token), so the tile size
need not match the cache's block size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import check_cache_pair, check_index_tensor, next_power_of_2

# A window wider than any context: key k is visible iff context_len - window <= k.
_NO_WINDOW = 1 << 30
_LOG2E = 1.4426950408889634


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    scale_log2, window, cap_log2, num_heads, num_partitions,
    stride_q_seq, stride_q_head, stride_o_seq, stride_o_head, stride_bt_seq,
    stride_c_block, stride_c_tok, stride_c_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PARTITION: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    lo = tl.maximum(part * PARTITION_SIZE, ctx - window)
    hi = tl.minimum((part + 1) * PARTITION_SIZE, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + g  # [G]
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    # A partition past the context (or before the window) reads and writes nothing: a grid sized
    # for max_model_len (CUDA graphs) costs a short context one load per empty program. The
    # reduce reads only the partitions that hold keys.
    if lo < hi:
        q_offs = seq * stride_q_seq + heads[:, None] * stride_q_head + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=gd_mask, other=0.0).to(tl.float32) * scale_log2  # [G, D]

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            tok = start + tl.arange(0, BLOCK_N)  # [N]
            t_mask = tok < hi
            bt_offs = seq * stride_bt_seq + tok // BLOCK_SIZE
            block = tl.load(block_tables_ptr + bt_offs, mask=t_mask, other=0).to(tl.int64)
            row = block * stride_c_block + (tok % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
            kv_mask = t_mask[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, N], log2 domain
            if HAS_SOFTCAP:  # cap * tanh(s / cap), in the log2 domain (cap_log2 = cap * log2(e))
                s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / cap_log2) + 1.0))
            s = tl.where(t_mask[None, :], s, float("-inf"))
            # Every tile holds at least one visible token, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new

        if SINGLE_PARTITION:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_offs = seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
            tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=gd_mask)
        else:
            stat = (seq * num_heads + heads) * num_partitions + part  # [G]
            tl.store(part_max_ptr + stat, m_i, mask=g < GROUP)
            tl.store(part_sum_ptr + stat, l_i, mask=g < GROUP)
            tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM + d[None, :], acc, mask=gd_mask)
    elif SINGLE_PARTITION and part == 0:  # an empty context: zeros
        o_offs = seq * stride_o_seq + heads[:, None] * stride_o_head + d[None, :]
        zeros = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        tl.store(out_ptr + o_offs, zeros.to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, context_lens_ptr, window,
    num_heads, num_partitions, stride_o_seq, stride_o_head,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PART_PAD: tl.constexpr, PARTITION_SIZE: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, PART_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    # the partitions that hold keys (the others were never written: see the partition kernel)
    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    first = tl.maximum(ctx - window, 0) // PARTITION_SIZE
    p_mask = (p >= first) & (p * PARTITION_SIZE < ctx) & (p < num_partitions)
    stat = (seq * num_heads + head) * num_partitions + p  # [P]
    m = tl.load(part_max_ptr + stat, mask=p_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + stat, mask=p_mask, other=0.0)  # noqa: E741
    pd_mask = p_mask[:, None] & (d < HEAD_DIM)[None, :]
    acc = tl.load(part_acc_ptr + stat[:, None] * HEAD_DIM + d[None, :], mask=pd_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # empty context: all weights 0
    w = tl.exp2(m - m_all)  # [P]; partitions without keys (m = -inf) weigh 0
    denom = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(denom > 0, denom, 1.0)
    o_offs = seq * stride_o_seq + head * stride_o_head + d
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    partition_size: int = 512,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Triton paged decode attention; arguments as ``ops.paged_decode_attention``.

    A sequence with context_len 0 gets a zero output. ``partition_size`` tokens per split-K
    program; ``block_n`` tokens per inner tile (power of two, default from head size and group);
    ``out`` (like query) to write into. ``partials``: the split-K scratch (running max, sum and
    output per partition: fp32 [S, H, P], [S, H, P], [S, H, P, D], P from the table's width) to
    use instead of new buffers; partitions without keys leave theirs untouched.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = check_cache_pair(key_cache, value_cache, head_dim)
    assert query.dtype in (torch.float32, torch.float16, torch.bfloat16), query.dtype
    assert query.stride(2) == 1, "query's head_dim must be contiguous"
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, block_tables.shape
    check_index_tensor(block_tables, "block_tables", query.device)
    assert context_lens.shape == (num_seqs,), context_lens.shape
    check_index_tensor(context_lens, "context_lens", query.device)
    assert partition_size > 0, partition_size
    assert sliding_window is None or sliding_window > 0, sliding_window
    assert softcap is None or softcap > 0, softcap
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1, out.shape
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad, dim_pad = next_power_of_2(group), next_power_of_2(head_dim)
    if block_n is None:  # keep the [G, N, D] product near 8k fp32 values per program
        block_n = max(16, 8192 // (group_pad * dim_pad))
    assert block_n & (block_n - 1) == 0, f"block_n must be a power of two, got {block_n}"
    max_context = block_tables.shape[1] * block_size  # bound without reading context_lens
    num_partitions = max(1, triton.cdiv(max_context, partition_size))
    single = num_partitions == 1
    part_shape = (num_seqs, num_heads, num_partitions)
    if partials is not None:
        part_max, part_sum, part_acc = partials
        assert part_max.shape == part_sum.shape == part_shape, (part_max.shape, part_shape)
        assert part_acc.shape == (*part_shape, head_dim) and part_acc.dtype == torch.float32, part_acc.shape
    else:
        part_max = query.new_empty(part_shape if not single else (1,), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        part_acc = query.new_empty((*part_shape, head_dim) if not single else (1,), dtype=torch.float32)
    window = _NO_WINDOW if sliding_window is None else sliding_window
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query, key_cache, value_cache, block_tables, context_lens,
        out, part_max, part_sum, part_acc,
        scale * _LOG2E, window, (softcap or 1.0) * _LOG2E, num_heads, num_partitions,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=dim_pad,
        PARTITION_SIZE=partition_size, BLOCK_N=block_n, SINGLE_PARTITION=single,
        HAS_SOFTCAP=softcap is not None,
    )  # fmt: skip
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_max, part_sum, part_acc, context_lens, window,
            num_heads, num_partitions, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=dim_pad, PART_PAD=next_power_of_2(num_partitions),
            PARTITION_SIZE=partition_size,
        )  # fmt: skip
    return out


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference: token by token, head by head, in fp32. Context_len 0 gives zeros."""
    num_seqs, num_heads, _ = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    for seq in range(num_seqs):
        context_len = int(context_lens[seq])
        first = 0 if sliding_window is None else max(0, context_len - sliding_window)
        slots = [(int(block_tables[seq, t // block_size]), t % block_size) for t in range(first, context_len)]
        if not slots:
            continue
        for head in range(num_heads):
            kv_head = head // group
            k = torch.stack([key_cache[b, o, kv_head] for b, o in slots]).float()  # [T, D]
            v = torch.stack([value_cache[b, o, kv_head] for b, o in slots]).float()
            logits = k @ query[seq, head].float() * scale  # [T]
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            weights = torch.softmax(logits, dim=0)
            out[seq, head] = (weights @ v).to(out.dtype)
    return out
