"""Torch side of the wire: pack one layer's blocks into frames, check them, unpack them.

A chunk is one layer's K and V for a run of blocks. Frames per chunk:

    native:  K [n, block_size, kv_heads, head_dim] (cache dtype),  V (same)
    int8:    Kq [n, block_size, kv_heads, head_dim] int8,  Ks [n, kv_heads] float32,  Vq,  Vs
             (ops.quantize_kv_int8: one symmetric scale per (block, head))

Every frame carries an xxh3_64 checksum in the chunk header.

Caches in host memory (the CPU platform) are read and written in place: one memcpy per run of
consecutive blocks, ``index_select`` straight into the staging slot otherwise. Caches in device
memory go through the thread's ``DeviceCopies``:

    pack:    gather on the device ─► device-to-host copy into the slot (copy stream) ─► event waited
             ─► the frames may be checksummed and sent
    unpack:  frames ─► pinned bounce ─► host-to-device copy (copy stream) ─► event waited
             ─► dequantize / scatter on the device ─► event waited ─► the blocks have landed
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Protocol

import torch
import xxhash

from pdserve.kernels import ops
from pdserve.kv_transfer.messages import WireFormat

FRAME_ALIGN = 64


class DevicePlatform(Protocol):
    """What the transfer needs of the engine's platform (engine/executor/platform.py), which it is handed
    rather than imports: kv_transfer stays free of engine modules. None means host memory."""

    separate_host: bool  # the caches are not in host memory

    def activate(self) -> None: ...
    def stream(self): ...
    def event(self): ...
    def use_stream(self, stream): ...
    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream=None) -> None: ...
    def uploaded(self, host: torch.Tensor) -> None: ...


def activate(platform: DevicePlatform | None) -> None:
    """Bind the calling thread to the platform's device (nothing for host memory)."""
    if platform is not None:
        platform.activate()


class DeviceCopies:
    """One thread's copies between caches in device memory and host memory: the platform, the
    thread's own copy stream (made once: not the default stream, which would serialize the copies
    with the engine's kernels) and a pinned bounce buffer for landing received frames.

    On the CPU platform (``on_host``) none of it is used: the caches are host memory."""

    def __init__(self, platform: DevicePlatform | None = None) -> None:
        self.platform = platform
        self.on_host = platform is None or not platform.separate_host
        self.stream = None if platform is None or self.on_host else platform.stream()
        self._bounce: torch.Tensor | None = None  # [capacity] uint8, grown to the largest chunk

    def bounce(self, num_bytes: int) -> torch.Tensor:
        """[num_bytes] uint8 of host memory (pinned where the platform pins) to upload from."""
        assert self.platform is not None, "host memory needs no bounce buffer"
        if self._bounce is None or self._bounce.numel() < num_bytes:
            self._bounce = self.platform.host_empty((num_bytes,), torch.uint8)
        return self._bounce[:num_bytes]

    def wait(self) -> None:
        """Block until everything queued on the copy stream so far has completed."""
        assert self.platform is not None, "host memory has no copy stream"
        done = self.platform.event()
        done.record(self.stream)
        done.synchronize()


class DevicePoolsNotViewable(ValueError):
    """Several ranks' caches in device memory seen as one: the transfer would read or land host
    bytes the ranks never compute with, so it refuses (a tensor-parallel node on a device is
    refused at start: node/transfer_caches.py)."""


class HeadSplitCache:
    """One layer's K (or V) cache of a tensor-parallel node, seen as the model's KV heads in order
    over its ranks' own caches (each [num_blocks, block_size, its heads, row], in host memory that
    rank 0 maps: engine/executor/executor.py). The transfer reads and writes this view, so the wire carries
    the model's heads in order whatever either side's layout: each node re-slices within itself,
    and a layout pair moves the bytes a single-rank pair moves. A read takes each head from the
    first rank that holds it; a write goes to every rank that holds it (ranks outnumbering the KV
    heads each hold a replica)."""

    def __init__(self, pools: list[torch.Tensor], heads: list[range]) -> None:
        assert len(pools) == len(heads) and pools, "one head range per rank's cache"
        if any(pool.device.type != "cpu" for pool in pools):
            raise DevicePoolsNotViewable(
                f"the ranks' caches are on {pools[0].device}: a HeadSplitCache views host pools only"
            )
        self.pools, self.heads = pools, heads
        first = pools[0]
        self.num_heads = max(r.stop for r in heads)
        self.shape = torch.Size((first.shape[0], first.shape[1], self.num_heads, first.shape[3]))
        self.dtype, self.device = first.dtype, first.device
        self.sources: list[tuple[torch.Tensor, range]] = []  # (rank's cache, heads) read, in order
        for pool, rng in zip(pools, heads, strict=True):
            covered = self.sources[-1][1].stop if self.sources else 0
            if rng.start == covered:
                self.sources.append((pool, rng))
        assert self.sources[-1][1].stop == self.num_heads, "the ranks' heads leave a gap"

    def element_size(self) -> int:
        return self.pools[0].element_size()

    def dim(self) -> int:
        return 4

    def __getitem__(self, block: int) -> torch.Tensor:
        """One block, every head: [block_size, heads, row]."""
        return self.gather(slice(block, block + 1), None)[0]

    def gather(
        self, run: slice | None, ids: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Blocks ``run`` (or ``ids``), every head: [n, block_size, heads, row]."""
        n = run.stop - run.start if run is not None else len(ids)  # type: ignore[arg-type]
        if out is None:
            out = torch.empty((n, *self.shape[1:]), dtype=self.dtype, device=self.device)
        for pool, rng in self.sources:
            out[:, :, rng.start : rng.stop].copy_(_select(pool, run, ids))
        return out

    def scatter(self, src: torch.Tensor, run: slice | None, ids: torch.Tensor | None) -> None:
        """Write blocks [n, block_size, heads, row] at ``run`` (or ``ids``), each head into every
        rank's cache that holds it."""
        for pool, rng in zip(self.pools, self.heads, strict=True):
            part = src[:, :, rng.start : rng.stop]
            if run is not None:
                pool[run].copy_(part)
            else:
                assert ids is not None  # given wherever there is no run
                pool.index_copy_(0, ids, part.contiguous())


def checksum(frame: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(frame)


def as_frame(tensor: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (works for bfloat16, which numpy lacks)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    # ndarray.data: the array's memoryview (numpy types memoryview(ndarray) only on 3.12+)
    return tensor.view(-1).view(torch.uint8).numpy().data


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
    copies: DeviceCopies | None = None,
) -> list[torch.Tensor]:
    """Gather one layer's blocks into ``slot`` (uint8, frame_offsets bytes); return the frames (uint8 views).

    key_cache, value_cache: [num_blocks, block_size, kv_heads, head_dim]; block_ids: [n], host ids.
    Caches in device memory need the thread's ``copies``; the frames are complete on return.
    """
    assert key_cache.shape == value_cache.shape and key_cache.dim() == 4, "cache layout nbhd-v1"
    assert block_ids.device.type == "cpu", "host block ids (device ones are made here)"
    n = len(block_ids)
    sizes = frame_sizes(tuple(key_cache.shape[1:]), key_cache.dtype, n, wire_format)
    frames = slot_frames(slot, sizes)
    if copies is not None and not copies.on_host:
        _refuse_head_split(key_cache)
        _pack_from_device(key_cache, value_cache, block_ids, wire_format, frames, copies)
        return frames
    assert key_cache.device.type == "cpu", "a cache in device memory needs its platform's DeviceCopies"
    if isinstance(key_cache, HeadSplitCache) and isinstance(value_cache, HeadSplitCache):
        run = _as_range(block_ids)
        if wire_format is WireFormat.NATIVE:
            shape = (n, *key_cache.shape[1:])
            for cache, frame in zip((key_cache, value_cache), frames, strict=True):
                cache.gather(run, block_ids, out=frame.view(cache.dtype).view(shape))
            return frames
        k, v = key_cache.gather(run, block_ids), value_cache.gather(run, block_ids)
        parts = [*ops.quantize_kv_int8(k), *ops.quantize_kv_int8(v)]
        for part, frame in zip(parts, frames, strict=True):
            frame.view(part.dtype).view(part.shape).copy_(part)
        return frames
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
        *ops.quantize_kv_int8(key_cache.index_select(0, block_ids)),
        *ops.quantize_kv_int8(value_cache.index_select(0, block_ids)),
    ]
    for part, frame in zip(parts, frames, strict=True):
        frame.view(part.dtype).view(part.shape).copy_(part)
    return frames


def _refuse_head_split(cache: torch.Tensor) -> None:
    """A platform whose pools are device memory with a HeadSplitCache: its pools are host memory
    (the memfds rank 0 maps), not the device pools the ranks compute with."""
    if isinstance(cache, HeadSplitCache):
        raise DevicePoolsNotViewable(
            "a tensor-parallel node's KV on a device platform: its HeadSplitCache holds host "
            "memory, not the ranks' device pools"
        )


def _pack_from_device(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    wire_format: WireFormat,
    frames: list[torch.Tensor],
    copies: DeviceCopies,
) -> None:
    """pack_layer for caches in device memory: the blocks are gathered (and quantized) on the
    device, each frame comes down in one device-to-host copy, and the copy stream's event is
    waited on before the frames are handed back, so nothing checksums bytes still on their way.

    The caches must be complete when this is called: the engine's step that wrote them has ended
    (its sampled token reached the host), so every kernel that wrote them has finished."""
    platform, stream = copies.platform, copies.stream
    assert platform is not None  # copies that are not on_host have one
    run = _as_range(block_ids)  # on the host ids: no device sync
    with platform.use_stream(stream):  # the gathers queue on the copy stream, ahead of their copies
        ids = None if run is not None else block_ids.to(key_cache.device)
        if wire_format is WireFormat.NATIVE:
            parts = [_select(cache.view(cache.shape[0], -1), run, ids) for cache in (key_cache, value_cache)]
        else:
            parts = [
                *ops.quantize_kv_int8(_select(key_cache, run, ids)),
                *ops.quantize_kv_int8(_select(value_cache, run, ids)),
            ]
        for part, frame in zip(parts, frames, strict=True):
            platform.copy(frame.view(part.dtype).view(part.shape), part, stream)  # device to host
    copies.wait()


def unpack_layer(
    frames: list[memoryview],
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    wire_format: WireFormat,
    copies: DeviceCopies | None = None,
) -> None:
    """Write one chunk's frames into the cache at ``block_ids`` (host ids); frame sizes must
    already be checked. Caches in device memory need the thread's ``copies``; the blocks have
    landed on return (the engine may read them)."""
    assert block_ids.device.type == "cpu", "host block ids (device ones are made here)"
    if copies is not None and not copies.on_host:
        _refuse_head_split(key_cache)
        _unpack_to_device(frames, key_cache, value_cache, block_ids, wire_format, copies)
        return
    assert key_cache.device.type == "cpu", "a cache in device memory needs its platform's DeviceCopies"
    k, v = _chunk_kv(frames, from_frame, key_cache, len(block_ids), wire_format)  # zero-copy views
    _land(k, v, key_cache, value_cache, _as_range(block_ids), block_ids)


def _unpack_to_device(
    frames: list[memoryview],
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_ids: torch.Tensor,
    wire_format: WireFormat,
    copies: DeviceCopies,
) -> None:
    """unpack_layer for caches in device memory: the frames go up in one host-to-device copy from
    the pinned bounce buffer, then are dequantized and scattered on the device."""
    platform, stream = copies.platform, copies.stream
    assert platform is not None  # copies that are not on_host have one
    sizes = [len(f) for f in frames]
    offsets, total = frame_offsets(sizes)
    host = copies.bounce(total)  # [total] uint8, the chunk laid out as in a staging slot
    for frame, offset in zip(frames, offsets, strict=True):
        host[offset : offset + len(frame)].copy_(from_frame(frame, torch.uint8, (len(frame),)))
    run = _as_range(block_ids)  # on the host ids: no device sync
    with platform.use_stream(stream):
        staged = torch.empty(total, dtype=torch.uint8, device=key_cache.device)  # [total] uint8
        platform.copy(staged, host, stream)  # host to device
        ids = None if run is not None else block_ids.to(key_cache.device)
    copies.wait()  # the upload is there, and the bounce buffer may take the next chunk
    platform.uploaded(host)  # nothing reads the host copy again (a test platform poisons it)
    with platform.use_stream(stream):
        k, v = _chunk_kv(slot_frames(staged, sizes), _typed_view, key_cache, len(block_ids), wire_format)
        _land(k, v, key_cache, value_cache, run, ids)
    copies.wait()  # landed: only now may the engine, on its own stream, read the blocks


def _chunk_kv(
    frames: list,
    typed: Callable[..., torch.Tensor],
    key_cache: torch.Tensor,
    n: int,
    wire_format: WireFormat,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's K and V [n, block_size, kv_heads, head_dim] in the cache dtype, dequantized for
    the int8 wire format. ``typed(frame, dtype, shape)`` views one frame: ``from_frame`` for
    received memoryviews, ``_typed_view`` for uint8 tensors on the device."""
    shape = (n, *key_cache.shape[1:])  # [n, block_size, kv_heads, head_dim]
    if wire_format is WireFormat.NATIVE:
        k, v = (typed(f, key_cache.dtype, shape) for f in frames)
        return k, v
    scale_shape = (n, shape[2])  # [n, kv_heads]
    kq, ks, vq, vs = frames
    k = ops.dequantize_kv_int8(
        typed(kq, torch.int8, shape), typed(ks, torch.float32, scale_shape), key_cache.dtype
    )
    v = ops.dequantize_kv_int8(
        typed(vq, torch.int8, shape), typed(vs, torch.float32, scale_shape), key_cache.dtype
    )
    return k, v


def _typed_view(frame: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 frame tensor viewed as ``dtype`` [shape] (frames start 64-byte aligned)."""
    return frame.view(dtype).view(shape)


def _land(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    run: slice | None,
    ids: torch.Tensor | None,
) -> None:
    """Write K and V [n, ...] into the blocks: a slice copy for a run, index_copy_ at ``ids``
    (on the cache's device) otherwise."""
    for cache, src in ((key_cache, k), (value_cache, v)):
        if isinstance(cache, HeadSplitCache):
            cache.scatter(src, run, ids)
            continue
        rows = cache.view(cache.shape[0], -1)  # [num_blocks, block_size * kv_heads * head_dim]
        if run is not None:
            rows[run].copy_(src.reshape(src.shape[0], -1))
        else:
            assert ids is not None  # given wherever there is no run
            rows.index_copy_(0, ids, src.reshape(src.shape[0], -1))


def _select(cache: torch.Tensor, run: slice | None, ids: torch.Tensor | None) -> torch.Tensor:
    """Rows ``run`` of the cache (a view) or rows ``ids`` (device ids; a gather)."""
    if run is not None:
        return cache[run]
    assert ids is not None  # given wherever there is no run
    return cache.index_select(0, ids)


def _as_range(block_ids: torch.Tensor) -> slice | None:
    """Host block_ids as a slice when they are consecutive (a fresh pool hands out runs): plain copies then."""
    first, last = int(block_ids[0]), int(block_ids[-1])
    if last - first + 1 != len(block_ids):
        return None
    consecutive = torch.arange(first, last + 1, device=block_ids.device)
    return slice(first, last + 1) if torch.equal(block_ids, consecutive) else None


def frame_sizes(
    block_shape: tuple[int, ...], dtype: torch.dtype, num_blocks: int, wire_format: WireFormat
) -> list[int]:
    """Expected byte size of each frame of a chunk of ``num_blocks`` blocks; block_shape: a
    cache's shape past its first dimension, (block_size, kv_heads, head_dim)."""
    block_size, kv_heads, head_dim = block_shape
    elems = num_blocks * block_size * kv_heads * head_dim
    if wire_format is WireFormat.NATIVE:
        size = elems * dtype.itemsize
        return [size, size]
    scales = num_blocks * kv_heads * 4  # float32 per (block, head)
    return [elems, scales, elems, scales]
