"""The CPU KV pool's pages are committed in bulk ahead of the blocks the engine hands out
(engine/executor/kv_prefault.py), without changing a byte of the pool."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.executor import kv_prefault
from pdserve.engine.executor.kv_prefault import PAGE, KVPrefault, populate
from tests.engine_helpers import grant_remote, hf_greedy
from tests.tiny_models import make_tiny_model

LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)

NUM_BLOCKS, BLOCK_SHAPE = 64, (16, 4, 64)  # 16 KB blocks: four pages each


def _fresh_caches(n: int) -> tuple[list[torch.Tensor], list[mmap.mmap]]:
    """Anonymous mappings nothing has touched yet: no page is resident."""
    maps = [mmap.mmap(-1, NUM_BLOCKS * 16 * 4 * 64 * 4) for _ in range(n)]
    caches = [torch.frombuffer(m, dtype=torch.float32).view(NUM_BLOCKS, *BLOCK_SHAPE) for m in maps]
    return caches, maps


def _residency(address: int, pages: int) -> bytes:
    """mincore's vector for ``pages`` pages from the page-aligned ``address``: bit 0 set = resident."""
    vec = ctypes.create_string_buffer(pages)
    assert LIBC.mincore(address, pages * PAGE, vec) == 0, ctypes.get_errno()
    return vec.raw


def _resident_blocks(cache: torch.Tensor) -> list[bool]:
    """Per block: are all its pages in memory (mincore)?"""
    block_bytes = cache.stride(0) * cache.element_size()
    vec = _residency(cache.data_ptr(), cache.shape[0] * block_bytes // PAGE)
    per_block = block_bytes // PAGE
    return [all(vec[b * per_block + i] & 1 for i in range(per_block)) for b in range(cache.shape[0])]


def _all_pages_resident(cache: torch.Tensor) -> bool:
    """Every page the tensor's bytes touch is in memory (the tensor need not start on a page)."""
    first = cache.data_ptr() - cache.data_ptr() % PAGE
    pages = -(-(cache.data_ptr() + cache.numel() * cache.element_size() - first) // PAGE)
    return all(b & 1 for b in _residency(first, pages))


@pytest.fixture
def fresh():
    caches, maps = _fresh_caches(2)
    yield caches
    del caches
    for m in maps:
        m.close()


def test_populate_commits_exactly_the_blocks_asked_for_and_changes_no_byte(fresh):
    key, value = fresh
    key[3].fill_(1.5)  # written before: its bytes must survive the prefault
    assert _resident_blocks(key) == [b == 3 for b in range(NUM_BLOCKS)]
    assert populate(fresh, 8, 20) == 0
    for cache in fresh:
        assert _resident_blocks(cache) == [
            8 <= b < 20 or (cache is key and b == 3) for b in range(NUM_BLOCKS)
        ]
    assert torch.all(key[3] == 1.5) and torch.all(key[8:20] == 0) and torch.all(value[8:20] == 0)


def test_the_prefault_stays_ahead_of_the_high_water_mark_in_steps_not_every_call(fresh):
    prefault = KVPrefault(fresh, NUM_BLOCKS, ahead=8)
    assert prefault.active and prefault.committed == 0
    prefault.advance(1)  # the first block handed out: commit 8 past it
    assert prefault.committed == 9 and _resident_blocks(fresh[1])[:10] == [True] * 9 + [False]
    prefault.advance(4)  # still more than ahead / 2 committed past it: nothing to do
    assert prefault.committed == 9
    prefault.advance(6)
    assert prefault.committed == 14
    prefault.advance(60)  # never past the pool
    assert prefault.committed == NUM_BLOCKS and all(_resident_blocks(fresh[0]))


def test_it_can_be_turned_off(fresh, monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_PREFAULT", "0")
    prefault = KVPrefault(fresh, NUM_BLOCKS, ahead=8)
    prefault.advance(5)
    assert not prefault.active and prefault.committed == 0 and not any(_resident_blocks(fresh[0]))


def test_the_engine_commits_ahead_of_what_it_writes_and_stays_exact():
    tiny_llama = str(make_tiny_model("llama"))
    prompts = [[5 + i, 17, 33 + i, 2] * (3 + 5 * i) for i in range(6)]  # 12-112 tokens
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for setting in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PDSERVE_KV_PREFAULT", setting)
            llm = LLM(tiny_llama, num_kv_blocks=512, max_num_seqs=4, max_num_batched_tokens=64, num_threads=1)
            outputs[setting] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            engine = llm.engine
            high, prefault = engine.block_manager.high_water, engine.kv_prefault
        if setting == "1":
            assert prefault.active and 0 < high <= prefault.committed <= high + prefault.ahead
        else:
            assert not prefault.active and prefault.committed == 0
    assert outputs["1"] == outputs["0"] == [hf_greedy(tiny_llama, p, 12) for p in prompts]


def test_a_fresh_engine_reuses_its_blocks_and_touches_only_the_kv_its_work_holds_at_once():
    """Blocks whose pages nobody committed in bulk go only where no freed block is free
    (engine/core/block_manager.py): a fresh offline engine's first call pays first-touch faults for its
    working set, not for every block it ever hands out. A pool committed at start-up keeps the
    prefix cache's order: never-used blocks first."""
    tiny_llama = str(make_tiny_model("llama"))
    prompts = [[5 + i, 17, 33 + i, 2] * (3 + 2 * (i % 14)) for i in range(28)]  # 12-116 tokens
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [hf_greedy(tiny_llama, p, 12) for p in prompts]
    used = {}
    for commit in ("idle", "startup"):
        llm = LLM(
            tiny_llama, num_kv_blocks=1024, max_num_seqs=4, block_size=16, kv_commit=commit, num_threads=1
        )
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
        engine = llm.engine
        used[commit] = engine.block_manager.high_water
        engine.block_manager.check_integrity([])
        if commit == "idle":  # offline: never idle, so nothing was committed in bulk; pages are
            # committed only ahead of the blocks handed out (residency is no test here: a small pool
            # can come from heap pages an earlier test in this process left resident)
            assert engine.kv_prefault.settled == 0
            assert engine.kv_prefault.committed <= engine.block_manager.high_water + engine.kv_prefault.ahead
    # at most 4 sequences of <= 8 blocks at once, and what the prefault commits ahead (4 blocks)
    assert used["idle"] <= 4 * 8 + 4 < 100 < used["startup"]


def test_blocks_reserved_for_incoming_kv_are_committed_before_it_lands():
    """A decode node's receiver copies a transfer into its reserved blocks between steps."""
    llm = LLM(
        str(make_tiny_model("llama")),
        num_kv_blocks=256,
        max_num_seqs=1,
        max_num_batched_tokens=16,
        num_threads=1,
    )
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=4)
    assert engine.kv_prefault.ahead == 1 and engine.kv_prefault.committed == 0  # a block per sequence
    grant_remote(engine, "far", [i % 250 for i in range(500)], params)  # 32 blocks
    assert engine.block_manager.high_water == 32 and engine.kv_prefault.committed == 33


@pytest.mark.parametrize("bulk", ["1", "0"])  # 0: no madvise: every page is written once instead
def test_kv_commit_startup_commits_the_whole_pool_before_the_first_request(monkeypatch, bulk):
    monkeypatch.setenv("PDSERVE_KV_PREFAULT", bulk)
    tiny_llama = str(make_tiny_model("llama"))
    llm = LLM(tiny_llama, num_kv_blocks=300, kv_commit="startup", num_threads=1)
    engine = llm.engine
    assert engine.kv_prefault.committed == 300
    for key_cache, value_cache in engine.runner.kv_caches:
        assert _all_pages_resident(key_cache) and _all_pages_resident(value_cache)
        assert not key_cache.any() and not value_cache.any()  # committed, not changed
    prompts = [[9, 4, 11 + i] * (2 + 7 * i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny_llama, p, 8) for p in prompts]


def test_kv_commit_is_idle_by_default_checked_and_a_node_flag():
    import argparse

    from pdserve.engine.config import EngineConfig
    from pdserve.node.options import add_node_args, options_from_args

    assert EngineConfig(model="m").kv_commit == "idle"
    with pytest.raises(ValueError, match="kv_commit"):
        EngineConfig(model="m", kv_commit="eager")
    parser = argparse.ArgumentParser()
    add_node_args(parser)
    model = str(make_tiny_model("llama"))
    for flags, want in (
        ([], "idle"),
        (["--kv-commit", "lazy"], "lazy"),
        (["--kv-commit", "startup"], "startup"),
    ):
        _, engine = options_from_args("decode", parser.parse_args(["--model", model, *flags]))
        assert engine.kv_commit == want
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", model, "--kv-commit", "eager"])


def _wait_until(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_the_idle_commit_fills_the_pool_while_idle_without_changing_a_byte(fresh):
    key, value = fresh
    key[40].fill_(2.5)  # written before: must survive
    prefault = KVPrefault(fresh, NUM_BLOCKS, ahead=4, idle_commit=True)
    prefault.advance(2)
    assert prefault.committed == 6 and not _resident_blocks(value)[6]
    prefault.idle()
    _wait_until(lambda: prefault.committed == NUM_BLOCKS)
    prefault._thread.join(5)
    assert not prefault._thread.is_alive()  # done: the thread ends and lets go of the pool
    assert all(_resident_blocks(key)) and all(_resident_blocks(value))
    assert torch.all(key[40] == 2.5) and not key[:40].any() and not value.any()


def test_an_engine_write_stops_the_idle_commit_until_the_engine_is_idle_again(monkeypatch):
    monkeypatch.setattr(kv_prefault, "SLICE_BYTES", PAGE)  # a page a call: many calls to stop between
    num_blocks = 8192
    maps = [mmap.mmap(-1, num_blocks * PAGE) for _ in range(2)]
    caches = [torch.frombuffer(m, dtype=torch.float32).view(num_blocks, PAGE // 4) for m in maps]
    prefault = KVPrefault(caches, num_blocks, ahead=1, idle_commit=True)
    try:
        prefault.idle()
        _wait_until(lambda: prefault.committed > 0)
        assert os.sched_getscheduler(prefault._thread.native_id) == os.SCHED_IDLE  # spare CPU only
        prefault.advance(0)  # the engine is about to write
        stopped_at = prefault.committed
        time.sleep(0.3)
        assert prefault.committed <= stopped_at + 1  # at most the slice it was in
        held = prefault.committed
        time.sleep(0.3)
        assert prefault.committed == held < num_blocks
        prefault.idle()
        _wait_until(lambda: prefault.committed == num_blocks)
        assert all(_resident_blocks(caches[0])) and all(_resident_blocks(caches[1]))
    finally:
        prefault.close()
        del caches
        for m in maps:
            m.close()


def test_the_idle_commit_waits_while_memory_is_short(fresh, monkeypatch):
    monkeypatch.setattr(kv_prefault, "MEMORY_RESERVE_BYTES", 1 << 60)
    prefault = KVPrefault(fresh, NUM_BLOCKS, ahead=4, idle_commit=True)
    try:
        prefault.idle()
        _wait_until(lambda: prefault.memory_paused)
        assert prefault.committed == 0 and not any(_resident_blocks(fresh[0]))
    finally:
        prefault.close()
    assert not prefault._thread.is_alive()


def test_nothing_commits_in_the_background_unless_asked_or_told_the_engine_is_idle(fresh):
    lazy = KVPrefault(fresh, NUM_BLOCKS, ahead=4)
    lazy.idle()
    assert lazy._thread is None
    idle = KVPrefault(fresh, NUM_BLOCKS, ahead=4, idle_commit=True)
    time.sleep(0.1)
    assert idle._thread is None and idle.committed == 0 and not any(_resident_blocks(fresh[0]))
