"""Several engines on one device: each charges itself only with its own process's memory
(engine/machine/sizing.py), checked on the split platform, whose emulated device every split
platform of a process shares (engine/executor/platform.py, SplitMemory)."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.executor.platform import SplitMemory, SplitPlatform
from pdserve.engine.machine.sizing import (
    DeviceMemory,
    device_start,
    measure_device,
    size_device_pool,
    size_engine,
    size_over_ranks,
)
from tests.tiny_models import make_tiny_model

GIB = 1 << 30
BLOCK = 1 << 20  # one KV block of the pools sized here


@pytest.fixture
def device(monkeypatch):
    """A 16 GiB emulated device with nothing else on it."""
    from pdserve.engine.executor import platform as platform_module

    monkeypatch.setattr(platform_module, "SPLIT_DEVICE_BYTES", 16 * GIB)
    assert platform_module.split_device_free() == 16 * GIB, "another split platform is still alive"


def _pool_blocks(platform: SplitPlatform, at_start, profile, util: float) -> int:
    """The KV blocks an engine on ``platform`` gets, sizing from ``at_start`` (its snapshot right
    after its context existed) around ``profile``."""
    model = ModelConfig.from_path(make_tiny_model("llama"))
    config = EngineConfig(
        model=model.path, dtype="float32", gpu_memory_utilization=util, max_num_seqs=1 << 20
    )
    sizing = size_engine(config, model, 4096, cpus=2, available_bytes=GIB)
    memory = measure_device(platform, profile, at_start, graphs=False)
    return size_device_pool(sizing, config, 4096, BLOCK, memory, "cuda:0").num_kv_blocks


def _step(memory: SplitMemory, activations: int):
    """A profile run: ``activations`` bytes held at its peak, then freed."""

    def run() -> None:
        memory.allocate(activations)
        memory.free(activations)

    return run


def test_two_engines_sizing_at_once_on_one_device_each_get_their_own_share(device):
    """A prefill and a decode node of `pdserve up` on one GPU, 45% each, start together: both
    contexts exist, then both load their weights, then each profiles while the other's memory
    is held. Each pool is its share less its own context, weights and peak, whatever the other
    took meanwhile (the device-wide drop in free memory would charge it the other's weights)."""
    a, b = SplitPlatform(memory=SplitMemory(context=GIB)), SplitPlatform(memory=SplitMemory(context=GIB))
    a_start, b_start = device_start(a), device_start(b)
    a.memory.allocate(2 * GIB)  # A's weights
    b.memory.allocate(3 * GIB)  # B's weights
    a_blocks = _pool_blocks(a, a_start, _step(a.memory, GIB), util=0.45)
    a.memory.allocate(a_blocks * BLOCK)  # A's pool, allocated before B has measured
    b_blocks = _pool_blocks(b, b_start, _step(b.memory, GIB // 2), util=0.45)
    share = int(16 * GIB * 0.45)
    assert a_blocks == (share - GIB - 2 * GIB - GIB) // BLOCK  # context, weights, peak activations
    assert b_blocks == (share - GIB - 3 * GIB - GIB // 2) // BLOCK


def test_a_tensor_parallel_pool_is_the_smallest_that_any_ranks_memory_allows():
    """Rank 1's device has another process's memory on it and its allocator reached more: the
    pool (one block count on every rank) is what rank 1 leaves, not rank 0."""
    model = ModelConfig.from_path(make_tiny_model("llama"))
    config = EngineConfig(model=model.path, dtype="float32", gpu_memory_utilization=0.5, max_num_seqs=1 << 20)
    sizing = size_engine(config, model, 4096, cpus=2, available_bytes=GIB)
    rank0 = DeviceMemory(80 * GIB, 79 * GIB, GIB, 12 * GIB, 12 * GIB, 9 * GIB)  # 40 - 13 = 27 GiB
    rank1 = DeviceMemory(80 * GIB, 50 * GIB, GIB, 20 * GIB, 20 * GIB, 9 * GIB)  # 40 - 21 = 19 GiB
    out = size_over_ranks(sizing, config, 4096, BLOCK, [rank0, rank1], "cuda:0")
    assert out.num_kv_blocks == 19 * GIB // BLOCK and "cuda:0 rank 1" in out.kv_source
    assert size_over_ranks(sizing, config, 4096, BLOCK, [rank0], "cuda:0").num_kv_blocks == 27 * GIB // BLOCK
    short = DeviceMemory(80 * GIB, 30 * GIB, GIB, 0, 0, 0)  # rank 1's device: 40 GiB is not free
    with pytest.raises(ValueError, match="cuda:0 rank 1's 80.0 GiB, but only 30.0 GiB is free"):
        size_over_ranks(sizing, config, 4096, BLOCK, [rank0, short], "cuda:0")


def test_an_engine_on_the_split_platform_is_not_charged_what_another_takes_while_it_profiles(monkeypatch):
    """A real engine on the split platform: while it profiles, another node on the device loads
    100 MiB (each layer's start is a moment in the profile). Its pool is all of its share."""
    from pdserve.engine.executor import platform as platform_module
    from pdserve.engine.llm_engine import LLMEngine

    monkeypatch.setenv(platform_module.TEST_PLATFORM_ENV, "split")
    monkeypatch.setattr(platform_module, "SPLIT_DEVICE_BYTES", 256 << 20)
    neighbour = SplitMemory(context=8 << 20)
    loads = iter([50 << 20, 50 << 20])  # its weights, then its pool, during this engine's profile
    on_layer = lambda: neighbour.allocate(next(loads, 0))  # noqa: E731
    path = str(make_tiny_model("llama"))
    config = EngineConfig(
        model=path, dtype="float32", block_size=4, gpu_memory_utilization=0.25, max_num_seqs=1 << 10
    )
    engine = LLMEngine(config, on_layer=on_layer)
    (own,) = engine.runner.profiled
    assert neighbour.reserved == 100 << 20  # it did load during the profile
    assert own.free_at_start == (256 - 8) << 20 and (own.context, own.reserved) == (0, 0)
    assert engine.kv_spec.num_blocks == (64 << 20) // engine.kv_spec.bytes_per_block  # all of 25%
    engine.close()


def test_without_nvml_a_cuda_context_is_taken_as_the_estimate():
    import torch

    from pdserve.engine.executor.platform import CUDA_CONTEXT_ESTIMATE, CUDAPlatform

    assert CUDAPlatform(torch.device("cuda", 0)).context_bytes() == CUDA_CONTEXT_ESTIMATE


@pytest.mark.usefixtures("processes")
def test_a_two_rank_engine_on_the_split_platform_sizes_from_both_ranks_measurements(monkeypatch):
    """Each rank measures its own process around the profile (rank 1 in its worker), and rank 0
    gathers both over the group (gloo here, NCCL on CUDA)."""
    from pdserve.engine.executor import platform as platform_module
    from pdserve.engine.llm_engine import LLMEngine

    monkeypatch.setenv(platform_module.TEST_PLATFORM_ENV, "split")  # the worker inherits it
    config = EngineConfig(
        model=str(make_tiny_model("llama")), block_size=4, tensor_parallel_size=2, max_num_seqs=4
    )
    engine = LLMEngine(config)
    try:
        assert [m.total for m in engine.runner.profiled] == [platform_module.SPLIT_DEVICE_BYTES] * 2
        assert (
            engine.runner.profiled[1].free_at_start == platform_module.SPLIT_DEVICE_BYTES
        )  # its own process
        assert "under 90% of 16.0 GiB on cpu rank" in engine.sizing.kv_source
    finally:
        engine.close()
