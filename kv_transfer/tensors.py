"""Torch side of the wire: pack one layer's blocks into frames, check them, unpack them.

A chunk is one layer's K and V for a run of blocks. Frames per chunk:

    native:  K [n, block_size, kv_heads, head_dim] (cache dtype),  V (same)
    int8:    Kq [n, block_size, kv_heads, head_dim] int8,  Ks [n, kv_heads] float32,  Vq,  Vs
             (kernels.quantize_kv_int8: one symmetric scale per (block, head))

Every frame carries an xxh3_64 checksum in the chunk header.
"""

from __future__ import annotations

import warnings

import torch
import xxhash

import kernels
from kv_transfer.messages import WireFormat

FRAME_ALIGN = 64


def checksum(frame: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(frame)


def as_frame(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (works for bfloat16, which numpy lacks)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


def from_frame(frame: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Zero-copy tensor over a received frame (read-only: only ever copied from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable
        return torch.frombuffer(frame, dtype=dtype).view(shape)


def frame_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Where each frame starts in a staging slot (64-byte aligned, so any dtype view works), and the total."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end = -(-(end + size) // FRAME_ALIGN) * FRAME_ALIGN
    return offsets, end


def slot_frames(slot: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Views of a uint8 staging slot, one per frame."""
    offsets, _ = frame_offsets(sizes)
    return [slot[o : o + n] for o, n in zip(offsets, sizes, strict=True)]


def pack_layer(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    wire_format: WireFormat,
    slot: torch.Tensor,
) -> list[torch.Tensor]:
    """Gather one layer's blocks into ``slot`` (uint8, frame_offsets bytes); return the frames (uint8 views).

    key_cache, value_cache: [num_blocks, block_size, kv_heads, head_dim]; block_ids: [n].
    """
    assert key_cache.shape == value_cache.shape and key_cache.dim() == 4, "cache layout nbhd-v1"
    n = len(block_ids)
    sizes = frame_sizes(tuple(key_cache.shape[1:]), key_cache.dtype, n, wire_format)
    frames = slot_frames(slot, sizes)
    if wire_format is WireFormat.NATIVE:
        run = _as_range(block_ids)
        for cache, frame in zip((key_cache, value_cache), frames, strict=True):
            out = frame.view(cache.dtype).view(n, -1)  # [n, block_size * kv_heads * head_dim]
            rows = cache.view(cache.shape[0], -1)  # [num_blocks, block_size * kv_heads * head_dim]
            if run is not None:
                out.copy_(rows[run])  # one contiguous memcpy
            else:  # into the preallocated slot: no allocation, no page faults
                torch.index_select(rows, 0, block_ids, out=out)
        return frames
    parts = [
        *kernels.quantize_kv_int8(key_cache.index_select(0, block_ids)),
        *kernels.quantize_kv_int8(value_cache.index_select(0, block_ids)),
    ]
    for part, frame in zip(parts, frames, strict=True):
        frame.view(part.dtype).view(part.shape).copy_(part)
    return frames


def unpack_layer(
    frames: list[memoryview],
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    wire_format: WireFormat,
) -> None:
    """Write one chunk's frames into the cache at ``block_ids``; frame sizes must already be checked."""
    shape = (len(block_ids), *key_cache.shape[1:])  # [n, block_size, kv_heads, head_dim]
    if wire_format is WireFormat.NATIVE:
        k, v = (from_frame(f, key_cache.dtype, shape) for f in frames)
    else:
        scale_shape = (shape[0], shape[2])  # [n, kv_heads]
        kq, ks, vq, vs = frames
        k = kernels.dequantize_kv_int8(
            from_frame(kq, torch.int8, shape), from_frame(ks, torch.float32, scale_shape), key_cache.dtype
        )
        v = kernels.dequantize_kv_int8(
            from_frame(vq, torch.int8, shape), from_frame(vs, torch.float32, scale_shape), value_cache.dtype
        )
    run = _as_range(block_ids)
    for cache, src in ((key_cache, k), (value_cache, v)):
        rows = cache.view(cache.shape[0], -1)  # [num_blocks, block_size * kv_heads * head_dim]
        if run is not None:
            rows[run].copy_(src.reshape(len(block_ids), -1))
        else:
            rows.index_copy_(0, block_ids, src.reshape(len(block_ids), -1))


def _as_range(block_ids: torch.Tensor) -> slice | None:
    """block_ids as a slice when they are consecutive (a fresh pool hands out runs): plain copies then."""
    first, last = int(block_ids[0]), int(block_ids[-1])
    if last - first + 1 != len(block_ids):
        return None
    return slice(first, last + 1) if torch.equal(block_ids, torch.arange(first, last + 1)) else None


def frame_sizes(
    block_shape: tuple[int, int, int], dtype: torch.dtype, num_blocks: int, wire_format: WireFormat
) -> list[int]:
    """Expected byte size of each frame of a chunk of ``num_blocks`` blocks."""
    block_size, kv_heads, head_dim = block_shape
    elems = num_blocks * block_size * kv_heads * head_dim
    if wire_format is WireFormat.NATIVE:
        size = elems * dtype.itemsize
        return [size, size]
    scales = num_blocks * kv_heads * 4  # float32 per (block, head)
    return [elems, scales, elems, scales]
