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


# --------------------------------------------------------------------------- tensor-parallel heads
# With tensor parallelism each rank's pool holds its own KV heads (the block tables are the same on
# every rank). A layout of ``tp`` ranks over a model of ``h`` KV heads is servable when each rank
# can hold whole heads (tp <= h: rank r holds a run of h // tp heads, one more for each of the
# first h % tp ranks: SmolLM2's 3 heads over 2 ranks are [0, 1] and [2]) or the heads' replicas
# evenly (tp > h, tp a multiple of h: each rank holds one head, and each head lives on tp/h ranks,
# as vLLM replicates them). A rank's query heads are those of its KV heads' groups. A prefill
# pool may differ in tp; ``transfer_plan`` says which prefill rank sends which heads to which
# decode rank. ``h`` is always the model's total: a rank's own count is never multiplied back
# (with replicas that overcounts, a bug SGLang shipped).
#
#     h = 2, prefill tp 2 -> decode tp 1      h = 1, prefill tp 1 -> decode tp 2
#     P0 [head 0] ─┐                          P0 [head 0] ─┬─► D0 [head 0]
#     P1 [head 1] ─┴─► D0 [head 0, head 1]                 └─► D1 [head 0]   (a replica each)


def check_tp_layout(num_kv_heads: int, tp_size: int) -> None:
    """ValueError unless ``tp_size`` ranks can hold ``num_kv_heads`` heads (see above)."""
    if num_kv_heads <= 0 or tp_size <= 0:
        raise ValueError(
            f"kv heads and tensor-parallel size must be positive, got {num_kv_heads} and {tp_size}"
        )
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor-parallel size {tp_size} exceeds the model's {num_kv_heads} KV heads and is "
            f"not a multiple of them (each head's replicas must be as many): choose at most "
            f"{num_kv_heads} ranks, or a multiple"
        )


def kv_heads_of(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads rank ``rank`` of ``tp_size`` holds, in order."""
    check_tp_layout(num_kv_heads, tp_size)
    assert 0 <= rank < tp_size, (rank, tp_size)
    if tp_size <= num_kv_heads:
        base, extra = divmod(num_kv_heads, tp_size)  # the first ``extra`` ranks hold one more
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def kv_owners(num_kv_heads: int, tp_size: int, head: int) -> range:
    """The ranks of ``tp_size`` that hold the model's KV head ``head`` (several: its replicas)."""
    check_tp_layout(num_kv_heads, tp_size)
    assert 0 <= head < num_kv_heads, (head, num_kv_heads)
    if tp_size <= num_kv_heads:
        owner = next(r for r in range(tp_size) if head in kv_heads_of(num_kv_heads, tp_size, r))
        return range(owner, owner + 1)
    replicas = tp_size // num_kv_heads
    return range(head * replicas, (head + 1) * replicas)


def query_heads_of(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's query heads rank ``rank`` computes: those of its KV heads' groups, or (the
    ranks outnumbering the KV heads) an even share of them, which falls in its head's group.
    ValueError naming the flag where they do not split so."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    kv = kv_heads_of(num_kv_heads, tp_size, rank)
    if tp_size <= num_kv_heads:
        group = num_heads // num_kv_heads
        return range(kv.start * group, kv.stop * group)
    if num_heads % tp_size:
        raise ValueError(f"attention heads: {num_heads} does not split over --tensor-parallel-size {tp_size}")
    per_rank = num_heads // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


@dataclasses.dataclass(frozen=True, slots=True)
class HeadPiece:
    """A run of consecutive KV heads one prefill rank sends one decode rank: in each block of each
    layer, K and V, ``num_heads`` rows of the block's every token."""

    src_rank: int  # the prefill rank that packs it
    dst_rank: int  # the decode rank it lands on
    src_head: int  # the first head's index in the prefill rank's pool
    dst_head: int  # ... and in the decode rank's pool
    num_heads: int


def transfer_plan(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[HeadPiece, ...]:
    """Which heads every decode rank receives, and from which prefill rank: each of its heads from
    one of the head's owners (decode rank j takes owner j mod replicas, spreading the load over a
    replicated head's ranks), consecutive heads of one owner as one piece. The pieces of a decode
    rank tile its pool's heads exactly once; a prefill rank that owns no chosen head sends
    nothing. The sender packs exactly these bytes and the receiver refuses anything else."""
    pieces: list[HeadPiece] = []
    for dst in range(decode_tp):
        dst_heads = kv_heads_of(num_kv_heads, decode_tp, dst)
        for head in dst_heads:
            owners = kv_owners(num_kv_heads, prefill_tp, head)
            src = owners[dst % len(owners)]
            src_head = head - kv_heads_of(num_kv_heads, prefill_tp, src).start
            dst_head = head - dst_heads.start
            last = pieces[-1] if pieces else None
            if (
                last is not None
                and (last.src_rank, last.dst_rank) == (src, dst)
                and (last.src_head + last.num_heads, last.dst_head + last.num_heads) == (src_head, dst_head)
            ):
                pieces[-1] = dataclasses.replace(last, num_heads=last.num_heads + 1)
            else:
                pieces.append(
                    HeadPiece(src_rank=src, dst_rank=dst, src_head=src_head, dst_head=dst_head, num_heads=1)
                )
    return tuple(pieces)
