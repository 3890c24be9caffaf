"""Block manager: exact block ids and ref counts, prefix caching, COW, and a property test."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.core.block_manager import BlockCopy, BlockManager
from pdserve.engine.core.sequence import Sequence
from pdserve.protocol.block_hash import hash_full_blocks
from pdserve.protocol.sampling_params import SamplingParams


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", list(tokens), len(tokens), SamplingParams())


def _prefill(bm: BlockManager, seq: Sequence) -> None:
    ids, hashes = bm.match_prefix(seq.token_ids, (seq.num_tokens - 1) // bm.block_size, seq.cache_root)
    bm.take_prefix(seq, ids, hashes)
    n = seq.num_uncomputed_tokens
    bm.append(seq, n)
    seq.num_computed_tokens += n
    bm.commit_computed(seq)


def test_allocate_takes_lowest_ids_first_and_free_returns_them():
    bm = BlockManager(num_blocks=6, block_size=4)
    seq = _seq(list(range(10)))
    assert bm.num_blocks_to_append(seq, 10) == 3
    assert bm.append(seq, 10) == []
    assert seq.block_table == [0, 1, 2]
    assert [b.ref_count for b in bm.blocks] == [1, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 3
    bm.free(seq)
    assert bm.num_free_blocks == 6
    bm.check_integrity([])


def test_append_slot_takes_a_new_block_only_at_a_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq([1, 2, 3])
    bm.append(seq, 3)
    seq.num_computed_tokens = 3
    assert bm.num_blocks_to_append(seq, 1) == 0  # slot 3 of block 0 is free
    bm.append(seq, 1)
    seq.num_computed_tokens = 4
    assert bm.num_blocks_to_append(seq, 1) == 1
    bm.append(seq, 1)
    assert seq.block_table == [0, 1]


def test_prefix_hit_shares_full_blocks_and_rechecks_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = _seq(list(range(10)))
    _prefill(bm, a)
    assert a.block_table == [0, 1, 2] and len(a.block_hashes) == 2
    b = _seq(list(range(8)) + [99, 98, 97])
    _prefill(bm, b)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == [0, 1] and b.block_table[2] == 3
    assert [bm.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # a collision (same hash, other tokens) must not be served: poison the stored tokens
    bm.blocks[0].token_ids = (7, 7, 7, 7)
    assert bm.match_prefix(list(range(8))) == ([], [])
    bm.check_integrity([a, b])


def test_blocks_cached_under_one_adapter_or_salt_match_only_the_same_keys():
    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(13))
    keys = [(None, None), (None, "a"), (None, "b"), ("lora-1", None), ("lora-1", "a"), ("lora-2", None)]
    seqs = [
        Sequence("r", list(tokens), 13, SamplingParams(adapter=adapter, cache_salt=salt))
        for adapter, salt in keys
    ]
    for seq in seqs:
        _prefill(bm, seq)
        assert seq.num_cached_tokens == 0, seq.params  # no other keys' blocks
    assert len({tuple(s.block_hashes) for s in seqs}) == len(keys)
    assert seqs[0].block_hashes == hash_full_blocks(tokens, 4)  # the plain chain is unchanged
    for adapter, salt in keys:
        again = Sequence("r", list(tokens), 13, SamplingParams(adapter=adapter, cache_salt=salt))
        _prefill(bm, again)
        assert again.num_cached_tokens == 12
        seqs.append(again)
    bm.check_integrity(seqs)


def test_full_prompt_hit_still_computes_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    _prefill(bm, _seq(list(range(8))))
    again = _seq(list(range(8)))
    _prefill(bm, again)
    assert again.num_cached_tokens == 4  # block 2 is recomputed so the last token yields logits


def test_freed_cached_blocks_are_evicted_in_lru_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = _seq([1, 2, 3, 4, 5]), _seq([6, 7, 8])
    _prefill(bm, a)  # blocks 0, 1, 2
    bm.free(a)  # freed tail first: 2, 1, 0 go to the back of the pool
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    assert bm.num_cached_free_blocks == 2  # blocks 0 and 1 hold full blocks
    _prefill(bm, b)  # needs 2 blocks: takes 3 and 2, keeping the cached ones
    assert b.block_table == [2, 3]
    c = _seq([9, 9, 9])
    _prefill(bm, c)  # evicts blocks 1 and 0 (freed in that order), handed out ascending
    assert c.block_table == [0, 1]
    assert bm.match_prefix([1, 2, 3, 4]) == ([], [])
    bm.check_integrity([b, c])


def test_past_its_fresh_limit_the_pool_reuses_a_freed_block_and_grows_only_when_none_is_free():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.fresh_limit = 2  # blocks 0 and 1 are committed; a CPU engine sets it (engine/executor/kv_prefault.py)
    a = _seq([1, 2, 3, 4, 5, 6])
    _prefill(bm, a)  # 3 blocks: nothing is free to reuse, so the pool grows past the limit
    assert a.block_table == [0, 1, 2] and bm.high_water == 3
    bm.free(a)  # 2, 1, 0 go to the back, cached
    b = _seq([7, 8, 9])
    _prefill(bm, b)  # reuses the oldest freed blocks (evicting 2 and 1) rather than touching 3 and 4
    assert b.block_table == [1, 2] and bm.high_water == 3
    assert bm.match_prefix([1, 2, 3, 4, 5])[0] == [0]  # block 0 is still cached
    c = _seq([9] * 8)
    _prefill(bm, c)  # 4 blocks: the one freed block, then fresh ones
    assert c.block_table == [0, 3, 4, 5] and bm.high_water == 6
    bm.fresh_limit = bm.num_blocks  # all committed (a GPU pool, or after the idle commit)
    d = _seq([5, 5])
    _prefill(bm, d)
    assert d.block_table == [6]  # never-used blocks first again, keeping the cached ones
    bm.check_integrity([b, c, d])


def test_evicting_an_older_copy_of_a_cached_block_keeps_the_newer_copy_findable():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.fresh_limit = 0  # reuse before growing: evictions come early
    a = _seq([1, 2, 3, 4, 5])
    _prefill(bm, a)  # blocks 0, 1, 2
    b = _seq([1, 2, 3, 4, 5])  # the same prompt computed again, as for its prompt logprobs
    bm.append(b, 5)
    b.num_computed_tokens = 5
    bm.commit_computed(b)
    assert b.block_table == [3, 4, 5]
    bm.free(a)
    c = _seq([9, 9, 9])
    _prefill(bm, c)  # evicts a's blocks 2 and 1
    assert sorted(c.block_table) == [1, 2]
    assert bm.match_prefix([1, 2, 3, 4, 5])[0] == [3, 4]  # b's copies still serve the prefix
    bm.check_integrity([b, c])


def test_fork_then_write_copies_the_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = _seq(list(range(6)))
    _prefill(bm, parent)
    child = _seq(list(range(6)))
    bm.fork(parent, child)
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2]
    assert bm.num_blocks_to_append(child, 1) == 1
    assert bm.append(child, 1) == [BlockCopy(src_block_id=1, dst_block_id=2)]
    assert child.block_table == [0, 2]
    assert bm.append(parent, 1) == []  # the last holder writes in place
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 1, 1]
    bm.check_integrity([parent, child])


@pytest.mark.usefixtures("processes")
def test_block_hashes_are_identical_in_another_process():
    tokens = list(range(100, 140))
    code = f"from pdserve.protocol.block_hash import hash_full_blocks; print(hash_full_blocks({tokens}, 16))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
        cwd=".",
    )
    assert out.stdout.strip() == str(hash_full_blocks(tokens, 16))
    # pinned: the value must never change between releases or machines (nodes compare hashes)
    assert hash_full_blocks(tokens, 16) == [0xB8410DE03D8EBD47, 0x97848BB05AF0216A]


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 7), st.integers(1, 9)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.sampled_from([12, 0, 5]))
def test_random_allocate_append_fork_free_keeps_accounting(program, fresh_limit):
    bm = BlockManager(num_blocks=12, block_size=4)
    bm.fresh_limit = fresh_limit
    live: list[Sequence] = []
    for op, pick, n in program:
        if op == "new":
            seq = _seq([pick % 3] * n)  # few distinct prompts, so prefix hits happen
            ids, hashes = bm.match_prefix(seq.token_ids, (n - 1) // 4)
            bm.take_prefix(seq, ids, hashes)
            if bm.can_append(seq, seq.num_uncomputed_tokens):
                bm.append(seq, seq.num_uncomputed_tokens)
                seq.num_computed_tokens = seq.num_tokens
                bm.commit_computed(seq)
                live.append(seq)
            else:
                bm.free(seq)
        elif live and op == "append":
            seq = live[pick % len(live)]
            seq.token_ids.extend([pick] * n)
            if bm.can_append(seq, n):
                bm.append(seq, n)
                seq.num_computed_tokens += n
                bm.commit_computed(seq)
            else:
                del seq.token_ids[-n:]
        elif live and op == "fork":
            parent = live[pick % len(live)]
            child = _seq(parent.token_ids)
            bm.fork(parent, child)
            live.append(child)
        elif live and op == "free":
            bm.free(live.pop(pick % len(live)))
        bm.check_integrity(live)
        assert all(b.ref_count >= 0 for b in bm.blocks)
    for seq in live:
        bm.free(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks
