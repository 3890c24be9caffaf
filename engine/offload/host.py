"""Blocks in host memory, in front of a device pool: the first tier below a GPU's, LRU within a
byte budget (``--kv-offload-host-mb``), in pinned memory where the platform pins (copies to and
from the device then run at full speed). A CPU node's pool is host memory already: it has none.

With a disk tier behind it, a block the host tier evicts goes to disk (written back, not lost);
without one it is dropped. Thread-safe: the engine thread keeps and looks up, the reader loads.
"""

from __future__ import annotations

import collections
import threading

import torch

from pdserve.engine.offload.disk import StoredBlock


class HostTier:
    def __init__(self, budget_bytes: int, pin: bool) -> None:
        if budget_bytes <= 0:
            raise ValueError(
                f"kv_offload_host_mb: the host tier's budget must be positive, got {budget_bytes}"
            )
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._lock = threading.Lock()
        self._blocks: collections.OrderedDict[int, StoredBlock] = collections.OrderedDict()  # LRU first
        self.num_bytes = 0

    def put(self, block: StoredBlock) -> list[StoredBlock]:
        """Keep ``block`` (most recently used); the blocks evicted to stay within the budget."""
        payload = block.payload
        if self.pin and not payload.is_pinned():
            payload = torch.empty_like(payload, pin_memory=True).copy_(payload)
            block = StoredBlock(block.block_hash, block.token_ids, payload)
        size = _size(block)
        evicted = []
        with self._lock:
            if block.block_hash in self._blocks:
                self._blocks.move_to_end(block.block_hash)
                return []
            self._blocks[block.block_hash] = block
            self.num_bytes += size
            while self.num_bytes > self.budget_bytes and len(self._blocks) > 1:
                _, old = self._blocks.popitem(last=False)
                self.num_bytes -= _size(old)
                evicted.append(old)
        return evicted

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block's payload (its tokens re-checked: a 64-bit collision is no hit)."""
        with self._lock:
            block = self._blocks.get(block_hash)
        return block.payload if block is not None and block.token_ids == token_ids else None

    def touch(self, block_hashes: list[int]) -> None:
        with self._lock:
            for block_hash in block_hashes:
                if block_hash in self._blocks:
                    self._blocks.move_to_end(block_hash)

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._blocks

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._blocks)


def _size(block: StoredBlock) -> int:
    return block.payload.numel() * block.payload.element_size()
