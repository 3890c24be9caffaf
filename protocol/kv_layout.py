"""The paged KV-cache layout: the one contract shared by engine/, kernels/ and kv_transfer/.

Per transformer layer there is one key cache and one value cache, each

    [num_blocks, block_size, num_kv_heads, head_dim]      (contiguous, row-major)

A token's KV lives in a *slot*: ``slot = block_id * block_size + offset_in_block``.
A sequence's block table lists its block ids in token order, so token ``t`` of a
sequence sits in block ``block_table[t // block_size]`` at offset ``t % block_size``:

    block_table = [7, 2, 9]          block_size = 4
    tokens:      0 1 2 3 | 4 5 6 7 | 8 9
    blocks:      [   7   ] [   2   ] [ 9 .. ]   (block 9 partly filled)

An int8 cache (``--kv-cache-dtype int8``, layout ``nbhd-q8-v1``) has the same shape but with
rows of ``head_dim + 4`` bytes: the row's head_dim int8 values, then its fp32 scale
(kernels/kv_int8.py). A block's scales thus travel inside its bytes.

This module is torch-free so the router and the wire protocol can import it.
"""

from __future__ import annotations

import dataclasses

KV_LAYOUT_NAME = "nbhd-v1"  # [num_blocks, block_size, num_kv_heads, head_dim], K and V apart, per layer
KV_INT8_LAYOUT_NAME = "nbhd-q8-v1"  # the same, rows of head_dim int8 values and their fp32 scale
INT8_SCALE_BYTES = 4  # after each int8 row's values

SUPPORTED_KV_DTYPES = ("float32", "float16", "bfloat16", "int8")


def row_width(head_dim: int, dtype: str) -> int:
    """Elements of one (token, head) row of a cache in ``dtype``: int8 rows carry their scale."""
    return head_dim + (INT8_SCALE_BYTES if dtype == "int8" else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape and dtype of one node's paged KV cache."""

    num_layers: int  # transformer layers, each with its own K and V cache
    num_blocks: int  # blocks in the pool (per layer, same ids across layers)
    block_size: int  # tokens per block
    num_kv_heads: int  # key/value heads (GQA: fewer than query heads)
    head_dim: int  # channels per head
    dtype: str  # one of SUPPORTED_KV_DTYPES

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"KVCacheSpec.{field} must be positive, got {getattr(self, field)}")
        if self.dtype not in SUPPORTED_KV_DTYPES:
            raise ValueError(f"KVCacheSpec.dtype must be one of {SUPPORTED_KV_DTYPES}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "int8": 1}.get(self.dtype, 2)

    @property
    def row_width(self) -> int:
        """Elements of one (token, head) row in the cache: head_dim, and an int8 row's scale bytes."""
        return row_width(self.head_dim, self.dtype)

    @property
    def layout(self) -> str:
        return KV_INT8_LAYOUT_NAME if self.dtype == "int8" else KV_LAYOUT_NAME

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V): [block_size, num_kv_heads, row_width]."""
        return (self.block_size, self.num_kv_heads, self.row_width)

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Bytes of K (or V alone) for one block in one layer."""
        return self.block_size * self.num_kv_heads * self.row_width * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V of one block across all layers."""
        return 2 * self.num_layers * self.bytes_per_block_per_layer

    @staticmethod
    def num_blocks_for_budget(
        budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str
    ) -> int:
        """How many blocks fit in a memory budget (at least one)."""
        probe = KVCacheSpec(num_layers, 1, block_size, num_kv_heads, head_dim, dtype)
        return max(1, budget_bytes // probe.bytes_per_block)
