"""Paged-KV operations, one dispatch function each.

Triton kernels run on CUDA tensors, the pure-torch paths on CPU; ``backend="triton"`` or
``backend="torch"`` forces one (Triton on CPU tensors needs ``TRITON_INTERPRET=1`` set
before triton is first imported in the process: see ``tests/test_kernels_triton.py``). The cache layout is defined once in ``protocol/kv_layout.py``.
Each Triton kernel's module also holds a simple pure-torch ``*_ref`` used by the tests.
On CPU the attention calls take the C++ extension of ``kernels/cpu_ext.py`` when it is built
(the default; ``PDSERVE_NATIVE_CPU=0`` or no compiler: the torch path).
On ``meta`` tensors (any backend) the KV write and the attention calls are shape-only fakes.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_ext, torch_fast
from pdserve.kernels.checks import check_cache_pair, check_index_tensor


def _use_triton(tensor: torch.Tensor, backend: str | None, cache: torch.Tensor | None = None) -> bool:
    if backend not in (None, "triton", "torch"):
        raise ValueError(f"backend must be None, 'triton' or 'torch', got {backend!r}")
    triton = tensor.is_cuda if backend is None else backend == "triton"
    if triton and cache is not None and cache.dtype == torch.int8:
        raise NotImplementedError("the int8 KV cache has CPU kernels only (no Triton path yet)")
    return triton


def native_cpu(tensor: torch.Tensor, backend: str | None = None) -> bool:
    """Whether attention on ``tensor`` runs the C++ CPU kernel (backend None, CPU, extension built)."""
    return backend is None and tensor.device.type == "cpu" and cpu_ext.enabled()


# The meta fakes: meta tensors have shapes and devices but no data, so a whole model forward
# runs on meta (tests/test_meta_forward.py), where a stray host tensor or a host sync raises.
# They assert the layouts and devices that the Triton wrappers assert, and compute nothing.
def _on_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


def _fake_kv_write(key, value, key_cache, value_cache, slot_mapping) -> None:
    # key, value: [T, KVH, D]; slot_mapping: [T]
    check_cache_pair(key_cache, value_cache, key.shape[-1])
    assert value.shape == key.shape and key.shape[1] == key_cache.shape[2], (key.shape, key_cache.shape)
    assert key.device == value.device == key_cache.device, (key.device, value.device, key_cache.device)
    assert slot_mapping.shape == key.shape[:1], (slot_mapping.shape, key.shape)
    check_index_tensor(slot_mapping, "slot_mapping", key_cache.device)


def _fake_attention(query, key_cache, value_cache, **index_tensors) -> torch.Tensor:
    # query: [T, H, D] -> an uninitialised [T, H, D]
    check_cache_pair(key_cache, value_cache, query.shape[-1])
    assert query.shape[1] % key_cache.shape[2] == 0, (query.shape, key_cache.shape)
    assert key_cache.device == query.device, (key_cache.device, query.device)
    for name, t in index_tensors.items():
        check_index_tensor(t, name, query.device)
    return torch.empty_like(query)


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
    if _on_meta(query):
        return _fake_attention(
            query,
            key_cache,
            value_cache,
            block_tables=block_tables,
            query_start_loc=query_start_loc,
            context_lens=context_lens,
        )
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
    if _on_meta(key):
        return _fake_kv_write(key, value, key_cache, value_cache, slot_mapping)
    if _use_triton(key, backend, key_cache):
        from pdserve.kernels.kv_write import write_kv_cache_triton

        return write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)
    if key_cache.dtype == torch.int8 and native_cpu(key, backend):  # one pass, not ten torch ops
        return cpu_ext.write_kv_int8_(key, value, key_cache, value_cache, slot_mapping)
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
    if _on_meta(query):
        return _fake_attention(
            query,
            key_cache,
            value_cache,
            block_tables=block_tables,
            query_start_loc=query_start_loc,
            context_lens=context_lens,
        )
    if _use_triton(query, backend, key_cache):
        from pdserve.kernels.paged_prefill import paged_prefill_attention_triton

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
    if _on_meta(query):
        return _fake_attention(
            query, key_cache, value_cache, block_tables=block_tables, context_lens=context_lens
        )
    if _use_triton(query, backend, key_cache):
        from pdserve.kernels.paged_decode import paged_decode_attention_triton

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
        from pdserve.kernels.block_copy import gather_blocks_triton

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
        from pdserve.kernels.block_copy import scatter_blocks_triton

        return scatter_blocks_triton(buffer, key_caches, value_caches, block_ids)
    return torch_fast.scatter_blocks(buffer, key_caches, value_caches, block_ids)


def quantize_kv_int8(x: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, block_size, kv_heads, head_dim] float -> (int8 like x, fp32 scales [n, kv_heads])."""
    if _use_triton(x, backend):
        from pdserve.kernels.kv_quant import quantize_kv_int8_triton

        return quantize_kv_int8_triton(x)
    return torch_fast.quantize_kv_int8(x)


def dequantize_kv_int8(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, backend: str | None = None
) -> torch.Tensor:
    """Inverse of ``quantize_kv_int8``: q * scale per (block, head), as ``dtype``."""
    if _use_triton(q, backend):
        from pdserve.kernels.kv_quant import dequantize_kv_int8_triton

        return dequantize_kv_int8_triton(q, scales, dtype)
    return torch_fast.dequantize_kv_int8(q, scales, dtype)
