"""Attention over the paged KV cache for one forward pass of a mixed batch.

The model runner orders each batch so that decode rows (one new token per sequence) come
first and prefill rows (chunks of prompts, possibly after a cached prefix) follow:

    query rows: [ d0 d1 d2 | p0 p0 p0 p0 p1 p1 ]
                  decodes     prefills (varlen, causal)

Decodes go to ``ops.paged_decode_attention``; prefills to ``ops.paged_prefill_attention``;
on CPU with the native kernel (kernels/cpu_ext.py), all rows go to one varlen call. Every path
reads the cache through block tables, after this step's K/V were written into their slots.
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.kernels import ops


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of every new token
    num_decode_tokens: int  # leading rows that are decodes, one per sequence
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, new token included
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, offsets into the prefill rows
    prefill_context_lens: torch.Tensor  # [num_prefills] int32, new tokens included
    # The whole batch at once (decodes are sequences of one row), for the varlen CPU kernel:
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, decodes first
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, offsets into all rows
    context_lens: torch.Tensor  # [num_seqs] int32, new tokens included
    backend: str | None = None  # kernels' backend: None picks by device, "triton" or "torch" forces one


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    # query: [T, H, D]; key, value: [T, KVH, D]; caches: [num_blocks, block_size, KVH, D]
    ops.write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping, backend=meta.backend)
    if ops.native_cpu(query, meta.backend):  # one call for decodes and prefill chunks alike
        return ops.paged_varlen_attention(
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.context_lens,
            scale,
            sliding_window,
            softcap,
        )
    num_decodes = meta.num_decode_tokens
    if num_decodes == query.shape[0]:
        return ops.paged_decode_attention(
            query,
            key_cache,
            value_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            sliding_window,
            softcap,
            backend=meta.backend,
        )
    prefill_out = ops.paged_prefill_attention(
        query[num_decodes:],
        key_cache,
        value_cache,
        meta.prefill_block_tables,
        meta.prefill_query_start_loc,
        meta.prefill_context_lens,
        scale,
        sliding_window,
        softcap,
        backend=meta.backend,
    )
    if num_decodes == 0:
        return prefill_out
    decode_out = ops.paged_decode_attention(
        query[:num_decodes],
        key_cache,
        value_cache,
        meta.decode_block_tables,
        meta.decode_context_lens,
        scale,
        sliding_window,
        softcap,
        backend=meta.backend,
    )
    return torch.cat([decode_out, prefill_out])
