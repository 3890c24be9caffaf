"""The KV offload tier: a folder of blocks that is exact, bounded, restart-safe and checked, and an
engine that serves evicted, preempted and pre-restart prefixes from it, equal to HF's output."""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_connector import KVTransfer
from pdserve.engine.executor.platform import TEST_PLATFORM_ENV
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.offload.disk import DiskTier, StoredBlock, TierInUse
from tests.engine_helpers import grant_remote, hf_greedy
from tests.tiny_models import make_tiny_model

SHAPE = (2, 2, 4, 3, 8)  # [layers, K/V, block_size, kv_heads, row]


def _block(seed: int, tokens=(1, 2, 3, 4)) -> StoredBlock:
    g = torch.Generator().manual_seed(seed)
    return StoredBlock(1000 + seed, tuple(tokens), torch.randn(SHAPE, generator=g))


def _files(tier: DiskTier) -> list[pathlib.Path]:
    return sorted(tier.folder.glob("*/*.kv"))


def test_a_stored_block_loads_back_bit_for_bit_and_survives_a_restart(tmp_path):
    tier = DiskTier(tmp_path, "ns", 1 << 20)
    block = _block(1)
    assert tier.store(block) and not tier.store(block)  # the second is there already
    assert torch.equal(tier.load(block.block_hash, block.token_ids), block.payload)
    tier.close()
    again = DiskTier(tmp_path, "ns", 1 << 20)  # a restart: the index comes from the folder
    assert block.block_hash in again and again.num_blocks == 1
    assert torch.equal(again.load(block.block_hash, block.token_ids), block.payload)
    assert again.load(block.block_hash, (9, 9, 9, 9)) is None  # other tokens: a collision, refused
    assert again.counts.corrupt == 1 and block.block_hash not in again  # ... and the file is gone


def test_a_corrupted_file_is_dropped_and_never_served(tmp_path):
    tier = DiskTier(tmp_path, "ns", 1 << 20)
    block = _block(2)
    tier.store(block)
    (path,) = _files(tier)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit in the payload
    path.write_bytes(bytes(data))
    assert tier.load(block.block_hash, block.token_ids) is None
    assert tier.counts.corrupt == 1 and not path.exists() and block.block_hash not in tier


def test_another_namespace_or_a_foreign_file_is_never_served(tmp_path):
    tier = DiskTier(tmp_path, "ns-a", 1 << 20)
    block = _block(3)
    tier.store(block)
    (path,) = _files(tier)
    other = DiskTier(tmp_path, "ns-b", 1 << 20)
    moved = other.folder / path.parent.name / path.name
    moved.parent.mkdir()
    path.rename(moved)  # a file written under another KV format, moved by hand
    (other.folder / "ab").mkdir(exist_ok=True)
    (other.folder / "ab" / "notes.txt").write_text("not a block")
    other.close()
    reopened = DiskTier(tmp_path, "ns-b", 1 << 20)
    assert reopened.counts.foreign == 1  # skipped with a log line
    assert reopened.load(block.block_hash, block.token_ids) is None  # its header names ns-a
    assert reopened.counts.corrupt == 1


def test_the_folder_keeps_to_its_budget_by_least_recent_use(tmp_path):
    one = len(DiskTier(tmp_path / "probe", "ns", 1 << 20)._encode(_block(0)))
    tier = DiskTier(tmp_path, "ns", 3 * one)
    blocks = [_block(i) for i in range(4)]
    for b in blocks[:3]:
        tier.store(b)
    tier.touch([blocks[0].block_hash])  # used again: the oldest is now blocks[1]
    tier.store(blocks[3])
    assert [b.block_hash in tier for b in blocks] == [True, False, True, True]
    assert tier.num_bytes <= 3 * one and len(_files(tier)) == 3 and tier.counts.evicted == 1
    tier.close()
    smaller = DiskTier(tmp_path, "ns", 2 * one)  # a restart with a smaller budget: the LRU goes
    assert [b.block_hash in smaller for b in blocks] == [True, False, False, True]


def test_a_second_node_on_the_same_folder_is_refused_and_half_written_files_are_cleared(tmp_path):
    tier = DiskTier(tmp_path, "ns", 1 << 20)
    with pytest.raises(TierInUse, match="in use by another pdserve node"):
        DiskTier(tmp_path, "ns", 1 << 20)
    sub = tier.folder / "00"
    sub.mkdir()
    stale = sub / ".0000000000000001.kv.123.ab.tmp"  # a writer that crashed mid-file
    stale.write_bytes(b"PDKV")
    os.utime(stale, (1, 1))
    tier.close()
    DiskTier(tmp_path, "ns", 1 << 20)
    assert not stale.exists()


# ---------------------------------------------------------------------- an engine with the tier
def _engine(path: str, folder, **options) -> LLMEngine:
    options = {"num_kv_blocks": 12, "block_size": 8, "kv_offload_dir": str(folder), **options}
    return LLMEngine(EngineConfig(model=path, **options))


def _run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict:
    """Each request's output and prompt-cache hit, the requests in one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
    return done


def _long(seed: int, n: int = 56) -> list[int]:
    return [(seed * 7 + 13 * i) % 250 + 3 for i in range(n)]


def test_an_evicted_prefix_comes_back_from_the_folder_equal_to_hf_and_after_a_restart(tmp_path):
    path = str(make_tiny_model("llama"))
    engine = _engine(path, tmp_path)
    first = _run(engine, {"a": _long(1)}, 4)  # 7 full blocks of 8 computed, then kept in the folder
    _run(engine, {"b": _long(2)}, 4)  # a 12-block pool: b's blocks evict a's
    engine.note_idle()  # the node's idle moment: what is pending goes to the folder
    assert engine.offload.flush()
    again = _run(engine, {"a2": _long(1)}, 4)
    assert again["a2"][0] == first["a"][0] == hf_greedy(path, _long(1), 4)
    assert again["a2"][1] == 48  # 6 blocks (never the last token's) loaded: usage reports them
    assert engine.stats().offload["loaded_blocks"] >= 6
    engine.close()
    restarted = _engine(path, tmp_path)  # the whole node again, on the same folder
    after = _run(restarted, {"a3": _long(1)}, 4)
    assert after["a3"] == (hf_greedy(path, _long(1), 4), 48)
    assert restarted.block_manager.num_free_blocks == 12
    restarted.close()


def test_corrupted_tier_files_change_no_output(tmp_path):
    path = str(make_tiny_model("llama"))
    engine = _engine(path, tmp_path)
    _run(engine, {"a": _long(3)}, 4)
    engine.close()  # everything pending is written
    files = sorted(tmp_path.glob("*/*/*.kv"))
    assert len(files) >= 6
    for f in files:  # every block damaged
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x01
        f.write_bytes(bytes(data))
    engine = _engine(path, tmp_path)
    out = _run(engine, {"a": _long(3)}, 4)
    assert out["a"] == (hf_greedy(path, _long(3), 4), 0)  # recomputed, not served
    assert engine.stats().offload["corrupt_blocks"] >= 1
    engine.close()


def test_preemption_offloads_and_reloads_with_the_same_greedy_output(tmp_path):
    """A pool too small for the batch's outputs: sequences are preempted; their blocks go to the
    tier and come back from it when they resume, and every output still equals HF's."""
    path = str(make_tiny_model("llama"))
    prompts = {f"p{i}": _long(10 + i, 12) for i in range(3)}  # 3 x (12 + 60) tokens: 27 blocks of 8
    options = dict(num_kv_blocks=16, debug_checks=True)
    plain = _run(LLMEngine(EngineConfig(model=path, block_size=8, **options)), prompts, 60)
    engine = _engine(path, tmp_path, **options)
    preempted = []
    finish = engine.scheduler._preempt

    def note(seq):  # the scheduler's preemptions, as they happen
        preempted.append(seq.request_id)
        finish(seq)

    engine.scheduler._preempt = note
    tiered = _run(engine, prompts, 60)
    for rid, prompt in prompts.items():
        assert tiered[rid][0] == plain[rid][0] == hf_greedy(path, prompt, 60), rid
    assert preempted  # the case this test is about
    assert engine.stats().offload["loaded_blocks"] > 0  # resumed from the tier, not recomputed
    assert max(hit for _, hit in tiered.values()) > 0
    assert engine.block_manager.num_free_blocks == 16
    engine.close()


def test_a_decode_engines_reservation_counts_its_tier_blocks_as_held(tmp_path):
    """The prefill node is told the true hit after the tier's lookup: it sends only the rest."""
    path = str(make_tiny_model("llama"))
    decode = _engine(path, tmp_path, num_kv_blocks=10)
    prompt = _long(5)
    _run(decode, {"warm": prompt}, 2)  # the decode node once prefilled it locally
    _run(decode, {"other": _long(6)}, 2)  # ... then evicted it from its pool
    decode.note_idle()
    assert decode.offload.flush()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reservation, _ = grant_remote(decode, "r", prompt, params)
    assert reservation.num_held_blocks == 6  # all but the last block came from the folder
    assert len(reservation.block_ids) == 1
    decode.abort_request("r")
    decode.close()


def test_a_prefill_engine_serves_its_prompt_from_the_tier_before_computing(tmp_path):
    path = str(make_tiny_model("llama"))
    prefill = _engine(path, tmp_path)
    prompt = _long(7)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prefill.add_request("x", prompt, params, kv_transfer=KVTransfer.SEND)
    while prefill.has_work():
        prefill.step()
    prefill.abort_request("x")  # the transfer ended: its blocks freed
    _run(prefill, {"evict": _long(8)}, 2)
    prefill.note_idle()
    assert prefill.offload.flush()
    prefill.add_request("y", prompt, params, kv_transfer=KVTransfer.SEND)
    outs = []
    while prefill.has_work():
        outs += prefill.step().outputs
    (out,) = outs
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == hf_greedy(path, prompt, 1)
    prefill.abort_request("y")
    prefill.close()


def test_a_host_tier_on_a_cpu_pool_is_refused_naming_the_flag():
    path = str(make_tiny_model("llama"))
    with pytest.raises(ValueError, match="kv_offload_host_mb.*host memory already"):
        LLMEngine(EngineConfig(model=path, num_kv_blocks=8, block_size=8, kv_offload_host_mb=64))


def _evicted_prompt(path, folder, seed: int) -> tuple[LLMEngine, list[int]]:
    """An engine whose folder holds a prompt its pool has evicted."""
    engine = _engine(path, folder)
    prompt = _long(seed)
    _run(engine, {"first": prompt}, 2)
    _run(engine, {"evict": _long(seed + 50)}, 2)
    engine.note_idle()
    assert engine.offload.flush()
    return engine, prompt


def test_a_slow_tier_degrades_to_recompute_at_its_deadline(tmp_path, monkeypatch):
    """A disk that answers later than the prefetch deadline (a fault caused by hand: the reader
    sleeps): the request stops waiting, computes its prompt, and its output is HF's."""
    path = str(make_tiny_model("llama"))
    engine, prompt = _evicted_prompt(path, tmp_path, 21)
    engine.offload.prefetch_timeout_s = 0.2
    load = engine.offload.disk.load

    def slow_load(block_hash, tokens):
        time.sleep(0.5)
        return load(block_hash, tokens)

    monkeypatch.setattr(engine.offload.disk, "load", slow_load)
    out = _run(engine, {"again": prompt}, 4)
    assert out["again"][0] == hf_greedy(path, prompt, 4)
    assert out["again"][1] < 48  # at most what was staged in time, the rest recomputed
    assert engine.stats().offload["timed_out_prefetches"] == 1
    engine.close()


def test_an_aborted_request_leaves_nothing_behind_in_the_tier_or_the_pool(tmp_path):
    path = str(make_tiny_model("llama"))
    engine, prompt = _evicted_prompt(path, tmp_path, 31)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    engine.add_request("w", prompt, params)
    engine.step()  # its lookup starts the prefetch; it waits for it
    assert engine.kv_connector._prefetches  # a fetch is under way for it
    engine.abort_request("w")
    assert not engine.kv_connector._prefetches and not engine.kv_connector.take_loads()
    assert not engine.has_work() and engine.block_manager.num_free_blocks == 12
    engine.scheduler.check_integrity()
    engine.close()


@pytest.mark.parametrize("with_disk", [False, True], ids=["host", "host-then-disk"])
def test_a_device_pools_host_tier_serves_evicted_blocks_and_spills_to_disk(tmp_path, monkeypatch, with_disk):
    """On the split platform (a GPU's separate device memory, on the CPU) a host tier sits in
    front of the pool; with a folder behind it, what the host tier evicts goes to disk."""
    monkeypatch.setenv(TEST_PLATFORM_ENV, "split")
    path = str(make_tiny_model("llama"))
    options = {"kv_offload_host_mb": 1, "kv_offload_dir": str(tmp_path) if with_disk else None}
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=12, block_size=8, **options))
    assert engine.platform.kind == "split"
    if with_disk:  # the tiny model's blocks are a few KiB: a host tier of 3 of them, the rest spill
        block = engine.executor.read_blocks([0])
        engine.offload.host.budget_bytes = 3 * block.numel() * block.element_size()
    first = _run(engine, {"a": _long(41)}, 4)
    _run(engine, {"b": _long(42)}, 4)
    engine.note_idle()
    assert engine.offload.flush()
    again = _run(engine, {"a2": _long(41)}, 4)
    assert again["a2"][0] == first["a"][0] == hf_greedy(path, _long(41), 4)
    assert again["a2"][1] == 48
    stats = engine.stats().offload
    assert stats["host_blocks"] > 0 and stats["loaded_blocks"] >= 6
    assert (stats["stored_blocks"] > 0) is with_disk  # the host tier's evictions, written back
    engine.close()
