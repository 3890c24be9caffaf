"""The engine's machine-dependent sizes, chosen once at start-up: torch threads and the KV pool.

Explicit settings win exactly (``num_threads``, ``num_kv_blocks``, ``kv_cache_memory_mb``).
Otherwise the threads are the CPUs this process may use (affinity and cgroup quota), and the KV
pool takes ``kv_cache_memory_fraction`` of the memory available now (as vLLM's CPU backend sizes
its KV-cache space), but never more than ``max_num_seqs`` sequences of ``max_model_len`` tokens
could fill. The pool's pages are touched only as blocks are first written (engine/model_runner.py),
so an idle pool costs address space, not memory.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from engine import resources
from engine.config import EngineConfig, ModelConfig
from engine.kv_layout import KVCacheSpec

log = logging.getLogger("pdserve.engine")

FALLBACK_AVAILABLE_BYTES = 4 << 30  # where the OS does not say how much memory is free


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSizing:
    num_threads: int  # torch intra-op threads
    threads_source: str  # why that many
    num_kv_blocks: int  # blocks in the KV pool
    kv_pool_bytes: int  # the pool's size, K and V of every layer
    kv_source: str  # why that size

    def describe(self, config: EngineConfig, extra: str = "") -> str:
        return (
            f"engine: {self.num_threads} torch threads ({self.threads_source}); KV pool "
            f"{self.kv_pool_bytes / (1 << 20):.0f} MiB = {self.num_kv_blocks} blocks x {config.block_size} "
            f"tokens ({self.kv_source}); max_num_seqs {config.max_num_seqs}; max_num_batched_tokens "
            f"{config.max_num_batched_tokens}{extra}"
        )


def size_engine(
    config: EngineConfig,
    model: ModelConfig,
    max_model_len: int,
    cpus: int | None = None,
    available_bytes: int | None = None,
) -> EngineSizing:
    """``cpus`` / ``available_bytes``: the machine's figures (read from the OS when None; tests pass them)."""
    if config.num_threads is not None:
        threads, threads_source = config.num_threads, "num_threads"
    else:
        threads, threads_source = cpus or resources.usable_cpus(), "usable CPUs"
        if config.max_threads is not None and config.max_threads < threads:
            threads, threads_source = config.max_threads, f"max_threads, of {threads} usable CPUs"
    probe = KVCacheSpec(
        model.num_layers, 1, config.block_size, model.num_kv_heads, model.head_dim, config.dtype
    )
    block_bytes = probe.bytes_per_block
    if config.num_kv_blocks is not None:
        blocks, kv_source = config.num_kv_blocks, "num_kv_blocks"
    elif config.kv_cache_memory_mb is not None:
        blocks, kv_source = max(1, (config.kv_cache_memory_mb << 20) // block_bytes), "kv_cache_memory_mb"
    else:
        blocks, kv_source = _auto_blocks(config, max_model_len, block_bytes, available_bytes)
    return EngineSizing(threads, threads_source, blocks, blocks * block_bytes, kv_source)


def _auto_blocks(
    config: EngineConfig, max_model_len: int, block_bytes: int, available_bytes: int | None
) -> tuple[int, str]:
    available = available_bytes if available_bytes is not None else resources.available_memory_bytes()
    where = "available"
    if available is None:
        available, where = FALLBACK_AVAILABLE_BYTES, "assumed available"
    share = int(available * config.kv_cache_memory_fraction)
    blocks = max(1, share // block_bytes)
    most_useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    source = f"{config.kv_cache_memory_fraction:.0%} of {available / (1 << 30):.1f} GiB {where}"
    if blocks > most_useful:
        blocks, source = most_useful, f"max_num_seqs x max_model_len, under {source}"
    return blocks, source


def announce(line: str) -> None:
    """Log the start-up line; with no logging configured anywhere, to stderr all the same."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.info(line)
