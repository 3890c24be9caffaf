"""The pure-torch references are right on hand-made cases, and torch_fast (the CPU path) matches them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kernels import torch_fast
from pdserve.kernels.block_copy import gather_blocks_ref, scatter_blocks_ref
from pdserve.kernels.kv_quant import dequantize_kv_int8_ref, quantize_kv_int8_ref
from pdserve.kernels.kv_write import write_kv_cache_ref
from pdserve.kernels.ops import dequantize_kv_int8, gather_blocks, quantize_kv_int8, scatter_blocks
from pdserve.kernels.paged_decode import paged_decode_attention_ref
from pdserve.kernels.paged_prefill import paged_prefill_attention_ref
from pdserve.kernels.testing import query_start_loc, random_paged_kv


def test_decode_ref_over_one_token_returns_its_value():
    kv = random_paged_kv([1], block_size=8, num_kv_heads=1, head_dim=4)
    query = torch.randn(1, 3, 4)
    out = paged_decode_attention_ref(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.5
    )
    block = int(kv.block_tables[0, 0])
    assert torch.equal(out[0], kv.value_cache[block, 0, 0].expand(3, 4))


def test_decode_ref_with_equal_keys_averages_the_window():
    kv = random_paged_kv([11], block_size=4, num_kv_heads=1, head_dim=4)
    kv.key_cache.fill_(1.0)
    query = torch.randn(1, 1, 4)
    out = paged_decode_attention_ref(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 1.0, 3
    )
    table = kv.block_tables[0].tolist()
    last_three = torch.stack([kv.value_cache[table[t // 4], t % 4, 0] for t in (8, 9, 10)])
    torch.testing.assert_close(out[0, 0], last_three.mean(0))


def test_prefill_ref_first_row_of_a_prompt_returns_first_value():
    kv = random_paged_kv([5], block_size=4, num_kv_heads=1, head_dim=4)
    query = torch.randn(5, 2, 4)
    out = paged_prefill_attention_ref(
        query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc([5]), kv.context_lens, 0.5
    )
    block = int(kv.block_tables[0, 0])
    assert torch.equal(out[0], kv.value_cache[block, 0, 0].expand(2, 4))


def test_prefill_ref_last_row_equals_decode_ref():
    kv = random_paged_kv([13, 6], block_size=4, num_kv_heads=2, head_dim=8)
    query = torch.randn(13 + 2, 6, 8)
    qsl = query_start_loc([13, 2])
    args = (kv.key_cache, kv.value_cache, kv.block_tables)
    prefill = paged_prefill_attention_ref(query, *args, qsl, kv.context_lens, 0.3, 4)
    decode = paged_decode_attention_ref(query[qsl[1:] - 1], *args, kv.context_lens, 0.3, 4)
    torch.testing.assert_close(prefill[qsl[1:] - 1], decode)


attention_cases = st.fixed_dictionaries(
    {
        "context_lens": st.lists(st.integers(1, 70), min_size=1, max_size=4),
        "block_size": st.sampled_from([8, 16, 32]),
        "num_kv_heads": st.sampled_from([1, 2]),
        "group": st.sampled_from([1, 3, 4]),
        "head_dim": st.sampled_from([8, 16]),
        "window": st.none() | st.integers(1, 40),
        "seed": st.integers(0, 1000),
    }
)


@settings(max_examples=30, deadline=None)
@given(case=attention_cases)
def test_torch_fast_decode_matches_ref(case):
    kv = random_paged_kv(case["context_lens"], case["block_size"], case["num_kv_heads"], case["head_dim"],
                         seed=case["seed"])  # fmt: skip
    query = torch.randn(len(case["context_lens"]), case["num_kv_heads"] * case["group"], case["head_dim"])
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.25, case["window"])
    torch.testing.assert_close(torch_fast.paged_decode_attention(*args), paged_decode_attention_ref(*args))


@settings(max_examples=30, deadline=None)
@given(case=attention_cases, data=st.data())
def test_torch_fast_prefill_matches_ref(case, data):
    context_lens = case["context_lens"]
    query_lens = [data.draw(st.integers(0, n)) for n in context_lens]  # 0 = empty, n = whole prompt
    kv = random_paged_kv(context_lens, case["block_size"], case["num_kv_heads"], case["head_dim"],
                         seed=case["seed"])  # fmt: skip
    query = torch.randn(sum(query_lens), case["num_kv_heads"] * case["group"], case["head_dim"])
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc(query_lens), kv.context_lens,
            0.25, case["window"])  # fmt: skip
    torch.testing.assert_close(torch_fast.paged_prefill_attention(*args), paged_prefill_attention_ref(*args))


@pytest.mark.parametrize("window", [None, 5])
def test_torch_fast_softcapped_attention_matches_ref(window):
    kv = random_paged_kv([17, 6], 8, 2, 24, seed=3)
    query = 3 * torch.randn(2, 4, 24)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.3, window, 2.0)
    decode = torch_fast.paged_decode_attention(*args)
    torch.testing.assert_close(decode, paged_decode_attention_ref(*args))
    uncapped = torch_fast.paged_decode_attention(*args[:-1])
    assert (decode - uncapped).abs().max().item() > 1e-2  # the cap really bends these logits
    prefill_query = 3 * torch.randn(23, 4, 24)  # one whole prompt, one chunk after a prefix
    args = (prefill_query, kv.key_cache, kv.value_cache, kv.block_tables, query_start_loc([17, 6]),
            kv.context_lens, 0.3, window, 2.0)  # fmt: skip
    torch.testing.assert_close(torch_fast.paged_prefill_attention(*args), paged_prefill_attention_ref(*args))


def test_torch_fast_kv_write_matches_ref():
    cache_shape = (4, 8, 2, 16)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3, 8, 9, 31, 16], dtype=torch.int32)  # mid-block, block starts, last slot
    fast = [torch.full(cache_shape, float("nan"), dtype=torch.float16) for _ in range(2)]
    ref = [c.clone() for c in fast]
    torch_fast.write_kv_cache(key, value, *fast, slots)
    write_kv_cache_ref(key, value, *ref, slots)
    for f, r in zip(fast, ref, strict=True):
        assert torch.equal(f.isnan(), r.isnan()) and torch.equal(f.nan_to_num(), r.nan_to_num())


def test_gather_then_scatter_moves_blocks_between_pools_exactly():
    src = [random_paged_kv([40], 8, 2, 16, seed=s) for s in range(3)]  # 3 layers, 7 blocks each
    block_ids = torch.tensor([4, 0, 6], dtype=torch.int64)
    keys, values = [kv.key_cache for kv in src], [kv.value_cache for kv in src]
    buffer = gather_blocks(keys, values, block_ids)
    assert buffer.shape == (3, 2, 3, 8, 2, 16)
    assert torch.equal(buffer, gather_blocks_ref(keys, values, block_ids))
    dst_ids = torch.tensor([1, 5, 2], dtype=torch.int32)
    dst_keys, dst_values = [torch.zeros_like(k) for k in keys], [torch.zeros_like(v) for v in values]
    ref_keys, ref_values = [torch.zeros_like(k) for k in keys], [torch.zeros_like(v) for v in values]
    scatter_blocks(buffer, dst_keys, dst_values, dst_ids)
    scatter_blocks_ref(buffer, ref_keys, ref_values, dst_ids)
    assert all(torch.equal(a, b) for a, b in zip(dst_keys + dst_values, ref_keys + ref_values, strict=True))
    assert torch.equal(dst_keys[2][5], keys[2][0]) and torch.equal(dst_values[1][2], values[1][6])


def test_torch_fast_quantize_matches_ref_and_stays_within_half_a_step():
    x = torch.randn(3, 8, 2, 16) * torch.tensor([1.0, 0.01, 100.0]).view(3, 1, 1, 1)
    x[1, :, 1] = 0.0  # an all-zero (block, head) tile
    q, scales = quantize_kv_int8(x)
    q_ref, scales_ref = quantize_kv_int8_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)
    assert scales[1, 1] == 0 and not q[1, :, 1].any()
    restored = dequantize_kv_int8(q, scales, torch.float32)
    assert torch.equal(restored, dequantize_kv_int8_ref(q, scales, torch.float32))
    error = (restored - x).abs()  # [n, bs, kvh, D]
    bound = scales[:, None, :, None] / 2 * (1 + 1e-5) + 1e-12
    assert bool((error <= bound).all()), (error / scales[:, None, :, None].clamp_min(1e-30)).max()
