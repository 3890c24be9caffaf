"""Block gather / scatter for KV transfer: pack a request's blocks of all layers into one buffer.

    buffer: [num_layers, 2, n, block_size, num_kv_heads, head_dim]     (2 = K, V)
    gather: buffer[l, 0, i] = key_caches[l][block_ids[i]]   (and V into buffer[l, 1, i])
    scatter: the inverse, into the receiver's own block ids

One Triton kernel copies whole blocks (as flat chunks) between a cache and a packed
buffer, in either direction; it runs once per layer and per K/V. For a single layer, pass
one-element lists (the buffer is then [1, 2, n, ...]).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.kernels.checks import check_cache, check_index_tensor

_CHUNK = 1024  # elements per program


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, block_ids_ptr, block_numel,
                        GATHER: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)  # index into block_ids (and into the packed buffer)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    packed = i.to(tl.int64) * block_numel + offs
    cached = block * block_numel + offs
    if GATHER:
        tl.store(dst_ptr + packed, tl.load(src_ptr + cached, mask=mask), mask=mask)
    else:
        tl.store(dst_ptr + cached, tl.load(src_ptr + packed, mask=mask), mask=mask)


def _check_caches(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_ids: torch.Tensor
) -> tuple[int, ...]:
    assert len(key_caches) == len(value_caches) and key_caches, (len(key_caches), len(value_caches))
    shape, dtype = tuple(key_caches[0].shape), key_caches[0].dtype
    for cache in [*key_caches, *value_caches]:
        check_cache(cache)
        assert tuple(cache.shape) == shape and cache.dtype == dtype, (cache.shape, cache.dtype, shape, dtype)
        assert cache.device == block_ids.device, (cache.device, block_ids.device)
    assert block_ids.dim() == 1, block_ids.shape
    check_index_tensor(block_ids, "block_ids", key_caches[0].device)
    return (len(key_caches), 2, block_ids.shape[0], *shape[1:])


def _launch(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    block_numel = math.prod(src.shape[1:])  # same for a cache and a packed buffer
    grid = (block_ids.shape[0], triton.cdiv(block_numel, _CHUNK))
    _copy_blocks_kernel[grid](src, dst, block_ids, block_numel, GATHER=gather, CHUNK=_CHUNK)


def gather_blocks_triton(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pack blocks ``block_ids`` of every layer into [num_layers, 2, n, block_size, kv_heads, head_dim]."""
    buffer_shape = _check_caches(key_caches, value_caches, block_ids)
    buffer = key_caches[0].new_empty(buffer_shape) if out is None else out
    assert tuple(buffer.shape) == buffer_shape and buffer.is_contiguous(), (buffer.shape, buffer_shape)
    assert buffer.dtype == key_caches[0].dtype, (buffer.dtype, key_caches[0].dtype)
    if block_ids.shape[0] == 0:
        return buffer
    for layer, caches in enumerate(zip(key_caches, value_caches, strict=True)):
        for kv, cache in enumerate(caches):
            _launch(cache, buffer[layer, kv], block_ids, gather=True)
    return buffer


def scatter_blocks_triton(
    buffer: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
) -> None:
    """Unpack a gathered buffer into blocks ``block_ids`` of every layer (inverse of gather)."""
    buffer_shape = _check_caches(key_caches, value_caches, block_ids)
    assert tuple(buffer.shape) == buffer_shape, (buffer.shape, buffer_shape)
    assert buffer.is_contiguous() and buffer.dtype == key_caches[0].dtype, (buffer.stride(), buffer.dtype)
    if block_ids.shape[0] == 0:
        return
    for layer, caches in enumerate(zip(key_caches, value_caches, strict=True)):
        for kv, cache in enumerate(caches):
            _launch(buffer[layer, kv], cache, block_ids, gather=False)


def gather_blocks_ref(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_ids: torch.Tensor
) -> torch.Tensor:
    """Reference: block by block."""
    n = block_ids.shape[0]
    buffer = key_caches[0].new_empty((len(key_caches), 2, n, *key_caches[0].shape[1:]))
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        for i, b in enumerate(block_ids.tolist()):
            buffer[layer, 0, i] = k[b]
            buffer[layer, 1, i] = v[b]
    return buffer


def scatter_blocks_ref(
    buffer: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_ids: torch.Tensor,
) -> None:
    """Reference: block by block."""
    for layer, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        for i, b in enumerate(block_ids.tolist()):
            k[b] = buffer[layer, 0, i]
            v[b] = buffer[layer, 1, i]
