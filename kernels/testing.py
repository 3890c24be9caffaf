"""Random paged KV caches with scattered block tables, for kernel tests and benchmarks."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, slots=True)
class PagedKV:
    """One layer's paged cache holding a batch of sequences."""

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # same
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32; padding holds valid ids
    context_lens: torch.Tensor  # [num_seqs] int32


def random_paged_kv(context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    spare_blocks: int = 2, seed: int = 0) -> PagedKV:  # fmt: skip
    """Each sequence gets its own blocks, shuffled across the pool; ``spare_blocks`` stay unused."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max([1, *blocks_per_seq])
    perm = torch.randperm(num_blocks, generator=gen)
    # padding entries: any valid block id (the kernels must never read past context_lens)
    block_tables = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen)
    used = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedKV(
        key_cache=torch.randn(shape, generator=gen).to(dtype=dtype, device=device),
        value_cache=torch.randn(shape, generator=gen).to(dtype=dtype, device=device),
        block_tables=block_tables.to(dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def query_start_loc(query_lens: list[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """[num_seqs + 1] int32 offsets of each sequence's rows in a packed varlen batch."""
    offsets = [0]
    for n in query_lens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)
