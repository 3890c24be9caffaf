"""A node's whole paged KV cache in one anonymous shared-memory file, readable by same-host peers.

The one-copy path of the transfer: a prefill node allocates its cache here; a decode node on
the same host maps it read-only through ``/proc/<pid>/fd/<fd>`` and copies the granted blocks
straight from the prefill node's cache into its own — no staging copy, no socket payload.

    memfd  [ layer 0: K blocks | V blocks | layer 1: K | V | ... ]   = [L, 2, num_blocks, bs, kvh, d]

The memory is a memfd (``kv_transfer.memfd``): not bound by /dev/shm's size, nothing leaks when
the process dies. Peers in another PID namespace or under another user cannot open it and fall
back to the staging ring or the socket.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
import xxhash

from pdserve.kv_transfer import memfd
from pdserve.kv_transfer.messages import CacheRef, KVFingerprint
from pdserve.protocol.kv_layout import KVCacheSpec, row_width

# a KV cache's dtype names (protocol/kv_layout.py); int8: rows with their scales (kernels/kv_int8.py)
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}


class SharedKVCache:
    """Raises OSError when the shared memory cannot be had (the caller falls back to private memory)."""

    def __init__(self, spec: KVCacheSpec) -> None:
        dtype = TORCH_DTYPES[spec.dtype]
        shape = (spec.num_layers, 2, spec.num_blocks, *spec.block_shape)
        self.fd, self._map = memfd.create("pdserve-kv-cache", spec.num_blocks * spec.bytes_per_block)
        self.tensor = torch.frombuffer(self._map, dtype=dtype).view(shape)  # [L, 2, NB, bs, kvh, d]
        self.ref = CacheRef(pid=os.getpid(), fd=self.fd, num_blocks=spec.num_blocks)

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(key_cache, value_cache) per layer, each [num_blocks, block_size, kv_heads, head_dim]."""
        return [(self.tensor[layer, 0], self.tensor[layer, 1]) for layer in range(self.tensor.shape[0])]


def attach(ref: CacheRef, fingerprint: KVFingerprint) -> torch.Tensor:
    """Read-only view [L, 2, num_blocks, bs, kvh, d] of a peer's shared cache; OSError when not allowed."""
    fp = fingerprint
    shape = (
        fp.num_layers,
        2,
        ref.num_blocks,
        fp.block_size,
        fp.num_kv_heads,
        row_width(fp.head_dim, fp.dtype),
    )
    dtype = TORCH_DTYPES[fp.dtype]
    mapped = memfd.attach(ref.pid, ref.fd, math.prod(shape) * dtype.itemsize)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only ever copy from it
        return torch.frombuffer(mapped, dtype=dtype).view(shape)


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive ids as (first id, length): [4, 5, 6, 9, 10] -> [(4, 3), (9, 2)]."""
    out: list[tuple[int, int]] = []
    for i in ids:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def paired_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs consecutive on both sides as (src first, dst first, length): one slice copy each."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def layer_checksum(key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: list[int]) -> int:
    """xxh3_64 over one layer's K blocks then V blocks, in the given order. Streamed over runs of
    consecutive blocks (one contiguous view each), so the digest does not depend on the layout."""
    h = xxhash.xxh3_64()
    id_runs = runs(block_ids)
    for cache in (key_cache, value_cache):
        rows = cache.reshape(cache.shape[0], -1)  # [num_blocks, bs * kvh * d], a view
        for first, length in id_runs:
            # ndarray.data: the array's memoryview (numpy types memoryview(ndarray) only on 3.12+)
            h.update(rows[first : first + length].view(torch.uint8).numpy().data.cast("B"))
    return h.intdigest()
