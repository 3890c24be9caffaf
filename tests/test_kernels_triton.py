"""Every Triton kernel matches its pure-torch reference on random paged inputs.

On a CUDA machine the compiled kernels run. Without one they run on CPU tensors in Triton's
interpreter, which only works when ``TRITON_INTERPRET=1`` is set before anything imports
triton (``@triton.jit`` and triton's own library functions read it once, at definition).
So without a GPU this module is skipped in the main pytest process, and the dry run of
bench/gpu_oneshot.sh (tests/test_gpu_oneshot.py) re-runs it in a child process with the variable
set, as the one-shot GPU check runs it compiled.
Sizes stay tiny for the interpreter. Outputs are poisoned (NaN, or an impossible int8)
before each run so an unwritten element fails.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRETED
if not (ON_GPU or INTERPRETED):
    pytest.skip(
        "no GPU: runs under TRITON_INTERPRET=1 in the one-shot script's dry run (test_gpu_oneshot.py)",
        allow_module_level=True,
    )
DEVICE = "cuda" if ON_GPU else "cpu"

from pdserve.kernels.block_copy import gather_blocks_ref, gather_blocks_triton, scatter_blocks_ref  # noqa: E402
from pdserve.kernels.kv_quant import dequantize_kv_int8_ref, quantize_kv_int8_ref, quantize_kv_int8_triton  # noqa: E402
from pdserve.kernels.kv_write import write_kv_cache_ref  # noqa: E402
from pdserve.kernels.ops import (  # noqa: E402
    dequantize_kv_int8,
    gather_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    quantize_kv_int8,
    scatter_blocks,
    write_kv_cache,
)
from pdserve.kernels.paged_decode import paged_decode_attention_ref, paged_decode_attention_triton  # noqa: E402
from pdserve.kernels.paged_prefill import paged_prefill_attention_ref, paged_prefill_attention_triton  # noqa: E402
from pdserve.kernels.testing import query_start_loc, random_paged_kv  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# (context_lens, block_size, num_kv_heads, group, head_dim, sliding_window)
DECODE_CASES = {
    "one-token-and-full-block-bs8": ([1, 8, 13], 8, 1, 1, 16, None),
    "mid-block-gqa3-bs16": ([5, 37], 16, 2, 3, 16, None),
    "gqa4-window-bs32": ([33, 70], 32, 1, 4, 8, 10),
    "window-wider-than-context": ([20], 8, 2, 1, 8, 64),
    "head-dim-not-power-of-two": ([9], 8, 1, 2, 12, None),
}


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def assert_int8_equal_up_to_ties(q: torch.Tensor, q_ref: torch.Tensor, x: torch.Tensor, scales: torch.Tensor):
    """Equal, except by one step where x / scale sits on a .5 tie (FMA or fp64 temporaries round it)."""
    diff = (q.int() - q_ref.int()).abs()
    y = (x.float() / scales[:, None, :, None]).nan_to_num()  # [n, bs, kvh, D] before rounding
    near_tie = ((y - y.floor()) - 0.5).abs() < 1e-4
    assert int(diff.max()) <= 1 and bool(((diff == 0) | near_tie).all()), diff.nonzero()


@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
@pytest.mark.parametrize("partition_size", [16, 512], ids=["split-k", "one-partition"])
def test_decode_matches_ref(case, partition_size):
    context_lens, block_size, num_kv_heads, group, head_dim, window = case
    kv = random_paged_kv(
        context_lens, block_size, num_kv_heads, head_dim, device=DEVICE, seed=len(context_lens)
    )
    query = torch.randn(len(context_lens), num_kv_heads * group, head_dim, device=DEVICE)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.3, window)
    out = paged_decode_attention_triton(
        *args, partition_size=partition_size, block_n=16, out=_poisoned(query)
    )
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision_matches_ref(dtype):
    kv = random_paged_kv([11, 30], 8, 2, 16, dtype=dtype, device=DEVICE)
    query = torch.randn(2, 6, 16, device=DEVICE).to(dtype)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.25)
    out = paged_decode_attention_triton(*args, partition_size=16, out=_poisoned(query))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), atol=tol, rtol=tol)


def test_decode_of_empty_batch_and_empty_context():
    kv = random_paged_kv([0, 3], 8, 1, 8, device=DEVICE)
    query = torch.randn(2, 1, 8, device=DEVICE)
    args = (kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 1.0)
    out = paged_decode_attention(query, *args, backend="triton")
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # no keys: zeros, not NaN
    torch.testing.assert_close(out, paged_decode_attention_ref(query, *args))
    empty = paged_decode_attention(query[:0], *args[:2], kv.block_tables[:0], kv.context_lens[:0], 1.0,
                                   backend="triton")  # fmt: skip
    assert empty.shape == (0, 1, 8)


@pytest.mark.parametrize("window", [None, 20])
def test_decode_partitions_past_a_short_context_do_no_work(window):
    """A table as wide as a long context (CUDA graphs capture it for max_model_len) over short
    contexts: only the partitions holding keys write their split-K partials; the others, past the
    context or before the window, leave them as they were (NaN here), and the reduce never reads
    them. The output equals the reference all the same."""
    context_lens, partition = [5, 40, 0, 17], 8
    kv = random_paged_kv(context_lens, 4, 2, 8, device=DEVICE, seed=3)
    width = 32  # 128 tokens of table: 16 partitions for contexts of at most 40
    tables = torch.zeros((4, width), dtype=torch.int32, device=DEVICE)
    tables[:, : kv.block_tables.shape[1]] = kv.block_tables
    query = torch.randn(4, 4, 8, device=DEVICE)
    shape = (4, 4, width * 4 // partition)
    partials = (
        _poisoned(torch.empty(shape)),
        _poisoned(torch.empty(shape)),
        _poisoned(torch.empty(*shape, 8)),
    )
    partials = tuple(t.to(DEVICE) for t in partials)
    args = (query, kv.key_cache, kv.value_cache, tables, kv.context_lens, 0.3, window)
    out = paged_decode_attention_triton(*args, partition_size=partition, block_n=16, partials=partials)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), atol=1e-5, rtol=1e-5)
    written = ~partials[0].isnan()  # [S, H, P]
    for seq, ctx in enumerate(context_lens):
        first = max(0, ctx - (window or ctx)) // partition
        holding = [first <= part and part * partition < ctx for part in range(shape[2])]
        assert written[seq].tolist() == [holding] * 4, (seq, ctx)
        assert bool((~partials[2][seq].isnan()).eq(written[seq][..., None]).all())


# (context_lens, query_lens, block_size, num_kv_heads, group, head_dim, sliding_window)
PREFILL_CASES = {
    "whole-prompts-bs8": ([13, 1], [13, 1], 8, 1, 1, 16, None),
    "prefix-hit-plus-chunk-gqa3-bs16": ([37, 20], [5, 20], 16, 2, 3, 16, None),
    "chunks-mid-block-gqa4-bs32-window": ([45, 9], [17, 1], 32, 1, 4, 16, 7),
    "empty-sequence-between-others": ([6, 8, 3], [2, 0, 3], 8, 1, 2, 32, None),
}


@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill_matches_ref(case):
    context_lens, query_lens, block_size, num_kv_heads, group, head_dim, window = case
    kv = random_paged_kv(context_lens, block_size, num_kv_heads, head_dim, device=DEVICE)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, device=DEVICE)
    qsl = query_start_loc(query_lens, device=DEVICE)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.3, window)
    out = paged_prefill_attention_triton(*args, block_m=16, block_n=16, out=_poisoned(query))
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not ON_GPU, reason="Triton's interpreter computes bf16 tl.dot wrongly (triton 3.9)"))])  # fmt: skip
def test_prefill_half_precision_matches_ref(dtype):
    kv = random_paged_kv([21, 4], 8, 2, 16, dtype=dtype, device=DEVICE)
    query = torch.randn(12, 4, 16, device=DEVICE).to(dtype)
    qsl = query_start_loc([8, 4], device=DEVICE)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.25)
    out = paged_prefill_attention_triton(*args, block_m=16, block_n=16, out=_poisoned(query))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=tol, rtol=tol)


@pytest.mark.skipif(not ON_GPU, reason="bf16 tl.dot is wrong in the interpreter; the point is the compile")
def test_prefill_bf16_head_dim_256_at_the_default_tiles_fits_and_matches_ref():
    """Gemma's head size in bf16 at the default 64 x 64 tiles: 3 stages would need 224 KB of
    shared memory, over the H100's 227 KB less Triton's own; prefill_tiles gives 2 (160 KB)."""
    kv = random_paged_kv([150, 40], 16, 1, 256, dtype=torch.bfloat16, device=DEVICE)
    query = torch.randn(100, 2, 256, device=DEVICE).to(torch.bfloat16)
    qsl = query_start_loc([70, 30], device=DEVICE)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.0625)
    out = paged_prefill_attention_triton(*args, out=_poisoned(query))
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 6])
def test_softcapped_decode_and_prefill_match_refs(window):
    # Gemma 2: logits -> cap * tanh(logits / cap); a cap of 2 bends every logit of these inputs.
    kv = random_paged_kv([19, 7], 8, 1, 24, device=DEVICE)
    query = 3 * torch.randn(2, 2, 24, device=DEVICE)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.3, window, 2.0)
    out = paged_decode_attention_triton(*args, partition_size=8, block_n=16, out=_poisoned(query))
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), atol=1e-5, rtol=1e-5)
    prefill_query = 3 * torch.randn(9, 2, 24, device=DEVICE)
    qsl = query_start_loc([5, 4], device=DEVICE)
    args = (
        prefill_query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        qsl,
        kv.context_lens,
        0.3,
        window,
        2.0,
    )
    out = paged_prefill_attention_triton(*args, block_m=16, block_n=16, out=_poisoned(prefill_query))
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=1e-5, rtol=1e-5)


def test_prefill_through_dispatch_with_no_tokens_returns_empty():
    kv = random_paged_kv([4], 8, 1, 16, device=DEVICE)
    query = torch.randn(0, 1, 16, device=DEVICE)
    qsl = query_start_loc([0], device=DEVICE)
    out = paged_prefill_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens,
                                  1.0, backend="triton")  # fmt: skip
    assert out.shape == (0, 1, 16)


def test_kv_write_fills_exactly_the_mapped_slots_from_a_strided_view():
    qkv = torch.randn(5, 3, 2, 16, device=DEVICE)  # K and V as strided views of a fused projection
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, 8, -1, 31, 16], dtype=torch.int64, device=DEVICE)  # -1: a padded row
    caches = [torch.full((4, 8, 2, 16), float("nan"), device=DEVICE, dtype=torch.float16) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv_cache(key, value, *caches, slots, backend="triton")
    write_kv_cache_ref(key, value, *expected, slots)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        assert int((~got.isnan()).sum()) == 4 * 2 * 16  # four slots written, the padded row nowhere


def test_gather_and_scatter_blocks_match_ref_across_layers():
    layers = [random_paged_kv([24], 8, 2, 16, device=DEVICE, seed=s) for s in range(2)]  # 5 blocks each
    keys, values = [kv.key_cache for kv in layers], [kv.value_cache for kv in layers]
    block_ids = torch.tensor([3, 0, 4], dtype=torch.int32, device=DEVICE)
    buffer = gather_blocks_triton(
        keys, values, block_ids, out=_poisoned(gather_blocks_ref(keys, values, block_ids))
    )
    assert torch.equal(buffer, gather_blocks_ref(keys, values, block_ids))
    dst_ids = torch.tensor([1, 2, 0], dtype=torch.int64, device=DEVICE)
    got_k, got_v = [_poisoned(k) for k in keys], [_poisoned(v) for v in values]
    want_k, want_v = [_poisoned(k) for k in keys], [_poisoned(v) for v in values]
    scatter_blocks(buffer, got_k, got_v, dst_ids, backend="triton")
    scatter_blocks_ref(buffer, want_k, want_v, dst_ids)
    for got, want in zip(got_k + got_v, want_k + want_v, strict=True):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert gather_blocks(keys, values, block_ids[:0], backend="triton").shape == (2, 2, 0, 8, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_ref_and_dequantize_error_is_half_a_step(dtype):
    x = torch.randn(3, 8, 2, 16, device=DEVICE) * torch.tensor([1.0, 0.01, 50.0], device=DEVICE).view(
        3, 1, 1, 1
    )
    x[1, :, 1] = 0.0
    x = x.to(dtype)
    out = (
        torch.full(x.shape, -128, dtype=torch.int8, device=DEVICE),
        torch.full((3, 2), float("nan"), device=DEVICE),
    )
    q, scales = quantize_kv_int8_triton(x, out=out)
    q_ref, scales_ref = quantize_kv_int8_ref(x)
    assert torch.equal(scales, scales_ref)
    assert_int8_equal_up_to_ties(q, q_ref, x, scales)
    restored = dequantize_kv_int8(q, scales, torch.float32, backend="triton")
    assert torch.equal(restored, dequantize_kv_int8_ref(q, scales, torch.float32))
    step = scales[:, None, :, None]
    assert bool(((restored - x.float()).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all())
    assert torch.equal(quantize_kv_int8(x, backend="triton")[1], scales)
