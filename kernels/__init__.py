"""Paged-KV operations, one dispatch function each.

Triton kernels run on CUDA tensors, the pure-torch paths on CPU; ``backend="triton"`` or
``backend="torch"`` forces one (Triton on CPU tensors needs ``TRITON_INTERPRET=1`` set
before triton is first imported in the process: see ``tests/test_kernels_interpreter.py``). The cache layout is defined once in ``engine/kv_layout.py``.
Each Triton kernel's module also holds a simple pure-torch ``*_ref`` used by the tests.
On CPU the attention calls take the C++ extension of ``kernels/cpu_ext.py`` when it is built
(the default; ``PDSERVE_NATIVE_CPU=0`` or no compiler: the torch path).
"""

from __future__ import annotations

import torch

from kernels import cpu_ext, torch_fast


def _use_triton(tensor: torch.Tensor, backend: str | None) -> bool:
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    if backend is None:
        return tensor.is_cuda
    return backend == "triton"


def native_cpu(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """Whether attention on ``tensor`` runs the C++ CPU kernel (backend None, CPU, extension built)."""
    return backend is None and tensor.device.type == "cpu" and cpu_ext.enabled()


def paged_varlen_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    context_lens,
    scale,
    sliding_window=None,
    softcap=None,
):
    """Decodes and prefill chunks of a whole batch in one call (CPU kernel only; see native_cpu)."""
    return cpu_ext.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        sliding_window,
        softcap,
    )


def write_kv_cache(key, value, key_cache, value_cache, slot_mapping, backend=None) -> None:
    """Scatter new tokens' K/V ([num_tokens, num_kv_heads, head_dim]) into their cache slots."""
    if _use_triton(key, backend):
        from kernels.kv_write import write_kv_cache_triton

        return write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    return torch_fast.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_prefill_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    query_start_loc,
    context_lens,
    scale,
    sliding_window=None,
    softcap=None,
    backend=None,
):
    """Causal attention of each sequence's new tokens over its cached context (varlen, chunked).

    ``softcap`` (Gemma 2): attention logits become softcap * tanh(logits / softcap) before the mask."""
    if _use_triton(query, backend):
        from kernels.paged_prefill import paged_prefill_attention_triton

        return paged_prefill_attention_triton(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            sliding_window,
            softcap,
        )
    if native_cpu(query, backend):
        return cpu_ext.paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            sliding_window,
            softcap,
        )
    return torch_fast.paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        sliding_window,
        softcap,
    )


def paged_decode_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    scale,
    sliding_window=None,
    softcap=None,
    backend=None,
):
    """Attention of one query token per sequence over its paged context."""
    if _use_triton(query, backend):
        from kernels.paged_decode import paged_decode_attention_triton

        return paged_decode_attention_triton(
            query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window, softcap
        )
    if native_cpu(query, backend):
        starts = torch.arange(query.shape[0] + 1, dtype=torch.int32)
        return cpu_ext.paged_attention(
            query, key_cache, value_cache, block_tables, starts, context_lens, scale, sliding_window, softcap
        )
    return torch_fast.paged_decode_attention(
        query, key_cache, value_cache, block_tables, context_lens, scale, sliding_window, softcap
    )


def gather_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    backend: str | None = None,
) -> torch.Tensor:
    """Pack blocks ``block_ids`` of all layers into one [num_layers, 2, n, block_size, kv_heads, head_dim]."""
    if _use_triton(key_caches[0], backend):
        from kernels.block_copy import gather_blocks_triton

        return gather_blocks_triton(key_caches, value_caches, block_ids)
    return torch_fast.gather_blocks(key_caches, value_caches, block_ids)


def scatter_blocks(
    buffer: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Write a ``gather_blocks`` buffer into blocks ``block_ids`` (any ids) of all layers."""
    if _use_triton(buffer, backend):
        from kernels.block_copy import scatter_blocks_triton

        return scatter_blocks_triton(buffer, key_caches, value_caches, block_ids)
    return torch_fast.scatter_blocks(buffer, key_caches, value_caches, block_ids)


def quantize_kv_int8(x: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, block_size, kv_heads, head_dim] float -> (int8 like x, fp32 scales [n, kv_heads])."""
    if _use_triton(x, backend):
        from kernels.kv_quant import quantize_kv_int8_triton

        return quantize_kv_int8_triton(x)
    return torch_fast.quantize_kv_int8(x)


def dequantize_kv_int8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, backend: str | None = None
) -> torch.Tensor:
    """Inverse of ``quantize_kv_int8``: q * scale per (block, head), as ``dtype``."""
    if _use_triton(q, backend):
        from kernels.kv_quant import dequantize_kv_int8_triton

        return dequantize_kv_int8_triton(q, scales, dtype)
    return torch_fast.dequantize_kv_int8(q, scales, dtype)
