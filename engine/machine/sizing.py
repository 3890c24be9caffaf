"""The engine's machine-dependent sizes, chosen once at start-up: torch threads and the KV pool.

Explicit settings win exactly (``num_threads``, ``num_kv_blocks``, ``kv_cache_memory_mb``).
Otherwise the threads are the CPUs this process may use (affinity and cgroup quota), and the KV
pool takes ``kv_cache_memory_fraction`` of the memory available now (as vLLM's CPU backend sizes
its KV-cache space), but never more than ``max_num_seqs`` sequences of ``max_model_len`` tokens
could fill. The pool's pages are touched only as blocks are first written (engine/executor/model_runner.py),
so an idle pool costs address space, not memory.

On a GPU the pool is sized after the weights are loaded and a profile run of the largest step
(engine/executor/model_runner.py ``profile``) has set the peak: of ``gpu_memory_utilization`` x the
device's memory, the pool gets what this process's CUDA context and its allocator's peak (the
weights and the step's activations) leave (vLLM's ``determine_available_memory`` pattern). The
utilization is this engine's share, and only this process's own memory is charged to it, never
the device-wide drop in free memory: other processes on the GPU (another node of ``pdserve up``,
starting at the same time) are not charged to it, but the share must fit in what is free at
start. At tensor-parallel size > 1 every rank measures its own device, and the pool (the same
block count on every rank) is the smallest that any rank's memory allows (``size_over_ranks``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.machine import resources
from pdserve.protocol.kv_layout import KVCacheSpec

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
            f"tokens ({self.kv_source}{', int8 rows' if config.kv_cache_dtype == 'int8' else ''}); max_num_seqs {config.max_num_seqs}; max_num_batched_tokens "
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
        model.num_layers, 1, config.block_size, model.num_kv_heads, model.head_dim, config.kv_dtype
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


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceStart:
    """One rank's device right after its CUDA context exists, before it allocates anything."""

    free: int  # the device's free bytes then (other processes' memory is not free)
    total: int  # the device's memory
    context: int  # this process's bytes outside torch's allocator: its context (Platform.context_bytes)


def device_start(platform) -> DeviceStart | None:
    """``platform``'s snapshot at start; None where the pool is sized from host RAM (size_engine)."""
    info = platform.mem_info()
    if info is None:
        return None
    free, total = info
    return DeviceStart(free, total, platform.context_bytes())


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What one rank measured of its device and of its own process, in bytes (tests inject these).

    Only this process's memory is charged to it: another process on the device (the other node
    of a `pdserve up` on one GPU) allocates while this one loads and profiles, and the device-wide
    drop in free memory would count that too (vLLM measures the same way: its baseline snapshot
    and the allocator's own counters)."""

    total: int  # the device's memory
    free_at_start: int  # free once this process's context existed (DeviceStart.free)
    context: int  # this process's bytes outside the allocator (DeviceStart.context)
    reserved: int  # the most torch's allocator reserved during the profile: weights, peak, its cache
    peak: int  # the most torch held in live tensors during the profile
    allocated: int  # what live tensors hold after it (the weights, mostly)
    graphs: bool = False  # CUDA graphs will hold a decode step's activations in their own pool

    @property
    def held(self) -> int:
        """What the engine needs besides its KV pool: its context and what its allocator
        reserved at the profile's peak, plus the peak's activations once more with graphs."""
        activations = max(0, self.peak - self.allocated)
        return self.context + self.reserved + activations * self.graphs


def measure_device(platform, profile, start: DeviceStart, graphs: bool) -> DeviceMemory:
    """Run ``profile()`` (the largest step) and read what this process's allocator reached: the
    weights it holds and the step's peak on top (``start``: the snapshot taken before the weights
    loaded)."""
    platform.synchronize()
    platform.empty_cache()
    platform.reset_peak()
    profile()
    platform.synchronize()
    peak, allocated = platform.peak_bytes() or 0, platform.allocated_bytes() or 0
    reserved = platform.peak_reserved_bytes() or peak
    platform.empty_cache()
    return DeviceMemory(start.total, start.free, start.context, reserved, peak, allocated, graphs)


@dataclasses.dataclass(frozen=True, slots=True)
class DraftNeeds:
    """What a draft model (``--speculative-model``) takes of the target engine's device share:
    its weights, and a pool of one draft block per target block plus ``extra_blocks``
    (engine/sampling/draft_model.py, ``draft_engine_config``). Its activations are not counted: it runs
    between the target's steps, in what the target's profiled step frees."""

    weight_bytes: int
    block_bytes: int  # one block of the draft's pool (every layer, K and V)
    extra_blocks: int

    @property
    def fixed_bytes(self) -> int:
        return self.weight_bytes + self.extra_blocks * self.block_bytes


def size_device_pool(
    sizing: EngineSizing,
    config: EngineConfig,
    max_model_len: int,
    block_bytes: int,
    memory: DeviceMemory,
    device: str,
    draft: DraftNeeds | None = None,
) -> EngineSizing:
    """``sizing`` with its KV pool sized to ``gpu_memory_utilization`` of the device; an explicit
    ``num_kv_blocks`` or ``kv_cache_memory_mb`` still wins. With a ``draft`` model, one budget
    holds both engines: the draft's weights and fixed blocks come off first, and each target block
    is paid for with its draft block. ValueError where the share does not fit in what is free, or
    leaves no room for a pool."""
    if sizing.kv_source in ("num_kv_blocks", "kv_cache_memory_mb"):
        return sizing
    gib = 1 << 30
    util = config.gpu_memory_utilization
    budget = int(memory.total * util)
    if budget > memory.free_at_start:
        raise ValueError(
            f"gpu_memory_utilization {util}: {budget / gib:.1f} GiB of {device}'s {memory.total / gib:.1f} "
            f"GiB, but only {memory.free_at_start / gib:.1f} GiB is free (other processes hold the "
            "rest); lower --gpu-memory-utilization"
        )
    held = memory.held + (draft.fixed_bytes if draft else 0)
    per_block = block_bytes + (draft.block_bytes if draft else 0)
    room = budget - held
    if room < per_block:
        what = "weights, the draft model and the profile run" if draft else "weights and the profile run"
        raise ValueError(
            f"gpu_memory_utilization {util}: {what} hold {held / gib:.2f} GiB of the {budget / gib:.2f} "
            "GiB share, leaving no room for a KV pool; raise --gpu-memory-utilization, or lower "
            "--max-num-batched-tokens / --max-num-seqs"
        )
    blocks = room // per_block
    source = (
        f"{util:.0%} of {memory.total / gib:.1f} GiB on {device}, less {held / gib:.2f} GiB for weights"
        + (", the draft model's weights and pool" if draft else "")
        + " and the profiled step"
    )
    most_useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    if blocks > most_useful:
        blocks, source = most_useful, f"max_num_seqs x max_model_len, under {source}"
    return dataclasses.replace(
        sizing, num_kv_blocks=blocks, kv_pool_bytes=blocks * block_bytes, kv_source=source
    )


def size_over_ranks(
    sizing: EngineSizing,
    config: EngineConfig,
    max_model_len: int,
    block_bytes: int,
    memories: list[DeviceMemory],
    device: str,
    draft: DraftNeeds | None = None,
) -> EngineSizing:
    """The pool every tensor-parallel rank can hold (the same block ids on each): sized from each
    rank's own measurement, the smallest wins, so a rank whose device has less free or more taken
    limits them all. ``block_bytes``: rank 0's block, the most heads any rank holds."""
    if len(memories) == 1:
        return size_device_pool(sizing, config, max_model_len, block_bytes, memories[0], device, draft)
    per_rank = [
        size_device_pool(sizing, config, max_model_len, block_bytes, memory, f"{device} rank {r}", draft)
        for r, memory in enumerate(memories)
    ]
    return min(per_rank, key=lambda s: s.num_kv_blocks)


def announce(line: str) -> None:
    """Log the start-up line; with no logging configured anywhere, to stderr all the same."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    log.info(line)
