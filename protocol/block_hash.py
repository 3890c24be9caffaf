"""Chained content hashes of full KV blocks, stable across processes and machines.

    hash(block i) = xxh3_64( hash(block i-1) as 8 little-endian bytes  ||  token ids as uint32 LE )

The chain makes a block's hash name its whole prefix, so equal hashes mean equal prefixes
(up to a 64-bit collision, which callers guard against by re-checking token ids). A request whose
KV depends on more than its tokens (a LoRA adapter, vLLM's cache_salt) starts its chain from a
root hash of those keys in place of "no parent" (``cache_root_of``): its blocks are found only by
requests with the same keys, on every node and in the router's prefix index alike.
Torch-free: the router hashes prompts too, to route by prefix.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence

import xxhash

_NO_PARENT = b"\x00" * 8
BLOCK_HASH_NAME = "xxh3_64-chained-u32le-v1"  # in the KV fingerprint: peers must hash alike


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block given the hash of the block before it (None for the first)."""
    parent = _NO_PARENT if parent_hash is None else struct.pack("<Q", parent_hash)
    return xxhash.xxh3_64_intdigest(parent + struct.pack(f"<{len(token_ids)}I", *token_ids))


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, start: int = 0, parent_hash: int | None = None
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on."""
    hashes = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[begin : begin + block_size])
        hashes.append(parent_hash)
    return hashes


@functools.lru_cache(maxsize=4096)
def cache_root_of(adapter: str | None, cache_salt: str | None) -> int | None:
    """The first block's parent for a request run with ``adapter`` and salted with ``cache_salt``;
    None (the plain chain) for neither."""
    if adapter is None and cache_salt is None:
        return None
    keys = b"\x00".join(
        b"" if key is None else b"\x01" + key.encode("utf-8", "surrogatepass")
        for key in (adapter, cache_salt)
    )
    return xxhash.xxh3_64_intdigest(b"pdserve-cache-root-v1\x00" + keys)
