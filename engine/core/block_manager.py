"""Paged KV block pool: ref-counted blocks, automatic prefix caching, copy-on-write.

A block is *used* while some sequence holds it (ref_count > 0) and *free* otherwise.
A free block that still holds a full, hashed block of tokens stays findable by hash
(an evictable prefix-cache entry) until the pool hands it out again. The free pool is
kept in LRU order: blocks freed longest ago are reused (evicted) first.

    free pool (LRU order) ──allocate──► used (ref_count ≥ 1) ──last free──► back of free pool
          ▲                                                                      │
          └───────────── prefix hit on an evictable block (ref 0 → 1) ◄──────────┘

Never-used blocks are handed out in ascending order, ahead of reused ones, while their memory is
committed (``fresh_limit``: the engine sets it from its KV prefault). Past that, a reused block
goes first and the pool grows only when none is free: a fresh CPU engine then takes first-touch
page faults for the most KV its work holds at once, not for every block of a pool sized from free
memory (engine/executor/kv_prefault.py). A pool whose memory is all committed (a GPU's, or a CPU node's
after its idle commit) keeps every block's cache entry as long as LRU order allows.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterable

from pdserve.engine.core.sequence import Sequence
from pdserve.protocol.block_hash import hash_block


@dataclasses.dataclass(slots=True)
class Block:
    block_id: int  # index into every layer's K/V cache
    ref_count: int = 0  # sequences whose block table holds this block
    block_hash: int | None = None  # chained content hash, set once the block is full and computed
    token_ids: tuple[int, ...] | None = None  # the tokens behind block_hash, to re-check on a hit


@dataclasses.dataclass(frozen=True, slots=True)
class BlockCopy:
    """A copy-on-write the model runner must perform before the step's forward pass."""

    src_block_id: int  # shared block being written to
    dst_block_id: int  # the writer's private copy


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        # One past the highest block id ever handed out. Never-used blocks go in ascending order,
        # so blocks [0, high_water) are the ones ever written.
        self.high_water = 0
        # free blocks that were handed out before, in the pool's LRU order (a subset of free_block_ids)
        self.released: OrderedDict[int, None] = OrderedDict()
        # never-used blocks at or past this one go only where no released block is free
        self.fresh_limit = num_blocks
        self.num_evictions = 0  # prefix-cache entries evicted so far (a lookup made before is stale)

    # ----------------------------------------------------------------- accounting
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (including evictable prefix-cache blocks)."""
        return len(self.free_block_ids)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still serve prefix hits until evicted."""
        return sum(1 for i in self.free_block_ids if self.blocks[i].block_hash is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------- prefix cache
    def match_prefix(
        self, token_ids: list[int], max_blocks: int | None = None, root: int | None = None
    ) -> tuple[list[int], list[int]]:
        """Leading full blocks of ``token_ids`` already cached: (block ids, their hashes).
        ``root``: the chain's start (Sequence.cache_root: a request's adapter and cache salt),
        so only requests with the same keys match.

        Read-only: take the blocks with ``take_prefix``. Stops at the first miss or at a hit
        whose stored tokens differ (a hash collision).
        """
        if not self.enable_prefix_caching:
            return [], []
        limit = len(token_ids) // self.block_size if max_blocks is None else max_blocks
        block_ids: list[int] = []
        hashes: list[int] = []
        parent = root
        for i in range(limit):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hash_block(parent, tokens)
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block_ids.append(block_id)
            hashes.append(parent)
        return block_ids, hashes

    def take_prefix(self, seq: Sequence, block_ids: list[int], hashes: list[int]) -> None:
        """Give an empty sequence the matched prefix blocks and mark their tokens computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "prefix goes on an empty sequence"
        for block_id in block_ids:
            self._take(block_id)
        seq.block_table = list(block_ids)
        seq.block_hashes = list(hashes)
        seq.num_computed_tokens = len(block_ids) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    # ----------------------------------------------------------------- allocation
    def num_blocks_to_append(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks ``append`` would take, copy-on-write included."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(needed, 0) + (1 if self._needs_copy_on_write(seq, num_new_tokens) else 0)

    def can_append(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.num_blocks_to_append(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
        """Make room for the next ``num_new_tokens`` KV slots of ``seq``; check with can_append first."""
        assert self.can_append(seq, num_new_tokens), "append without room"
        copies = []
        if self._needs_copy_on_write(seq, num_new_tokens):
            old = seq.block_table[-1]
            new = self._allocate_fresh()
            self._release(old)
            seq.block_table[-1] = new
            copies.append(BlockCopy(old, new))
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        # The LRU picks which blocks; ascending order makes runs of consecutive ids (freed blocks
        # come back tail first), so gathers, transfers and copies touch few contiguous ranges.
        seq.block_table.extend(sorted(self._allocate_fresh() for _ in range(needed)))
        return copies

    def _needs_copy_on_write(self, seq: Sequence, num_new_tokens: int) -> bool:
        # Only a partly filled last block is ever written again; full blocks are immutable.
        partial = seq.num_computed_tokens % self.block_size != 0
        return (
            num_new_tokens > 0
            and partial
            and bool(seq.block_table)
            and self.blocks[seq.block_table[-1]].ref_count > 1
        )

    def commit_computed(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed as prefix-cache entries."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = seq.block_hashes[i - 1] if i > 0 else seq.cache_root
            block_hash = hash_block(parent, tokens)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids = block_hash, tokens
                # the newest block of this content: an older copy (a request that recomputed its
                # prompt for its logprobs) is evicted first, and would take the entry with it
                self.hash_to_block_id[block_hash] = block.block_id

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (n > 1 samples of one prompt)."""
        for block_id in parent.block_table:
            self._take(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def truncate(self, seq: Sequence) -> None:
        """Give back the blocks past ``seq.num_computed_tokens`` (slots of rejected speculative
        drafts). They were appended after its last commit, so none holds a hashed block."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            assert self.blocks[block_id].block_hash is None, "a truncated block is in the prefix cache"
            self._release(block_id)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's blocks. Tail blocks go first, so they are evicted first."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    # ----------------------------------------------------------------- internals
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
            self.released.pop(block_id, None)
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None
            self.released[block_id] = None

    def _allocate_fresh(self) -> int:
        head = next(iter(self.free_block_ids))
        if head >= self.high_water and head >= self.fresh_limit and self.released:
            block_id, _ = self.released.popitem(last=False)  # reuse rather than grow (module doc)
            del self.free_block_ids[block_id]
        else:
            block_id, _ = self.free_block_ids.popitem(last=False)
            self.released.pop(block_id, None)
        self.high_water = max(self.high_water, block_id + 1)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its prefix-cache entry
            self.num_evictions += 1
            if self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids = None, None
        block.ref_count = 1
        return block_id

    def check_integrity(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Assert the pool's invariants; with ``seqs``, also that ref counts match their tables."""
        used = [b for b in self.blocks if b.ref_count > 0]
        assert all(b.ref_count >= 0 for b in self.blocks), "negative ref count"
        assert len(used) + self.num_free_blocks == self.num_blocks, "free + used != total"
        assert all(self.blocks[i].ref_count == 0 for i in self.free_block_ids), "free block with refs"
        assert self.released.keys() <= self.free_block_ids.keys(), "a released block is not free"
        for block_hash, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].block_hash == block_hash, f"stale hash entry for block {block_id}"
        if seqs is not None:
            refs = [0] * self.num_blocks
            for seq in seqs:
                for block_id in seq.block_table:
                    refs[block_id] += 1
            for block in self.blocks:
                assert refs[block.block_id] == block.ref_count, f"block {block.block_id} ref count mismatch"
