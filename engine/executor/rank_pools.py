"""Each tensor-parallel rank's KV pool, as rank 0 holds it.

At several ranks with pools in host memory every pool lives in a memfd that rank 0 makes and maps (``SharedPool``) and
hands its worker beside an AllocateKV (SCM_RIGHTS; engine/executor/rank_messages.py). Rank 0 so sees every
rank's heads in place, and a node's KV transfer reads and writes them there without a collective
beside the steps'. The engine itself reads only rank 0's pool; ``RankPool`` is what it offers the
node, which wraps the pools for the transfer (the engine knows nothing of the transfer).

Pools in device memory (CUDA, or the split platform that stands in for it) cannot be mapped
that way: each rank allocates its own, and rank 0 sees only its own (``PoolsNotShared``).
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import torch

from pdserve.engine.executor.model_runner import KV_TORCH_DTYPES
from pdserve.protocol.kv_layout import KVCacheSpec

LayerCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V)


class PoolsNotShared(RuntimeError):
    """The other ranks' KV pools are in their own devices' memory, which rank 0 does not map: no
    view of every rank's heads exists (a host copy would be stale bytes, never the pools the
    ranks compute with). Rank 0 opening them through CUDA IPC handles would lift this."""


@dataclasses.dataclass(frozen=True, slots=True)
class RankPool:
    """One rank's KV pool, seen from rank 0 (Executor.rank_pools)."""

    rank: int  # the tensor-parallel rank that computes with this pool
    kv_heads: range  # the model's KV heads it holds, in order (protocol.kv_layout.kv_heads_of)
    # per layer (K, V), each [num_blocks, block_size, len(kv_heads), row]; the same block ids on
    # every rank (one BlockManager, rank 0's)
    layer_caches: LayerCaches


class SharedPool:
    """One rank's KV pool [L, 2, num_blocks, block_size, heads, row] in a memfd: made by rank 0
    (``fd`` None) or mapped by the worker it was handed to. Its pages are committed as blocks are
    first written, like a private pool's."""

    def __init__(self, spec: KVCacheSpec, fd: int | None = None) -> None:
        size = spec.num_blocks * spec.bytes_per_block
        if fd is None:
            fd = os.memfd_create("pdserve-kv-rank", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        assert os.fstat(fd).st_size >= size, "the memfd is smaller than the pool's spec"
        self.fd, self._map = fd, mmap.mmap(fd, size)
        shape = (spec.num_layers, 2, spec.num_blocks, *spec.block_shape)
        self.tensor = torch.frombuffer(self._map, dtype=KV_TORCH_DTYPES[spec.dtype]).view(shape)

    def layer_caches(self) -> LayerCaches:
        """Per layer (K, V) views, each [num_blocks, block_size, heads, row]."""
        return [(self.tensor[layer, 0], self.tensor[layer, 1]) for layer in range(self.tensor.shape[0])]
