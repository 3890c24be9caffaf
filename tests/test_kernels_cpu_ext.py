"""The CPU paged-attention extension (kernels/cpu_ext.py) against the pure-torch references."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.kernels import cpu_ext, ops, torch_fast
from pdserve.kernels.paged_decode import paged_decode_attention_ref
from pdserve.kernels.paged_prefill import paged_prefill_attention_ref
from pdserve.kernels.testing import query_start_loc, random_paged_kv


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ext.load() is not None, "the extension could not be built: is a C++ compiler installed?"


def _varlen(
    seed, query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32
):
    kv = random_paged_kv(context_lens, block_size, num_kv_heads, head_dim, dtype=dtype, seed=seed)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    return query.to(dtype), kv, query_start_loc(query_lens)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("head_dim", [32, 64])  # 64: the register-blocked P.V of prefill tiles
def test_varlen_matches_prefill_reference_on_mixed_rows(num_heads, num_kv_heads, window, softcap, head_dim):
    # decodes (1 row), whole prompts, chunks after a cached prefix; one-token context; lengths off
    # the block size; shuffled block tables (random_paged_kv); a prompt past one key chunk (128)
    query_lens = [1, 1, 16, 3, 40, 33, 150]
    context_lens = [1, 17, 16, 20, 40, 100, 200]
    q, kv, qsl = _varlen(3, query_lens, context_lens, num_heads, num_kv_heads, head_dim, 8)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.2, window, softcap)
    out = cpu_ext.paged_attention(*args)
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_dispatch_matches_decode_reference(block_size):
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 300]
    kv = random_paged_kv(lens, block_size, 2, 64, seed=5)
    q = torch.randn(len(lens), 8, 64)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.125, 7)
    assert ops.native_cpu(q)
    torch.testing.assert_close(ops.paged_decode_attention(*args), paged_decode_attention_ref(*args))


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 3), (9, 3), (10, 2), (16, 2), (16, 1)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (100, None), (None, 3.0)])
def test_register_decode_path_matches_reference(num_heads, num_kv_heads, head_dim, window, softcap):
    # fp32 decode rows with head_dim 32 / 64 / 128 and groups of up to 8 heads take the register-held
    # path (16 / 1 heads: the general one); contexts past one key chunk (128), block sizes off 16,
    # and prefill rows in the same call, which keep the general path
    query_lens = [1, 1, 1, 5, 1]
    context_lens = [1, 129, 1000, 40, 257]
    q, kv, qsl = _varlen(11, query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.1, window, softcap)
    out = cpu_ext.paged_attention(*args)
    torch.testing.assert_close(out, paged_prefill_attention_ref(*args), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (16, 2), (16, 1)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (100, None), (None, 3.0)])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 5, 1], [1] * 9])  # 9 decodes: whole-sequence items
def test_bf16_register_decode_is_the_fp32_one_rounded(
    num_heads, num_kv_heads, head_dim, window, softcap, query_lens
):
    # A bf16 cache is widened exactly and then run through the fp32 arithmetic, so on the register
    # path (AVX-512 builds) its output must be the fp32 kernel's on the same (widened) values,
    # rounded once to bf16: bit for bit. Where the scores come from bf16 dot products (AVX512-BF16)
    # the products are the same exact fp32 values summed in another order, so an output differs
    # only where that moved it across a bf16 rounding boundary: by one bf16 step, in few places.
    # The plain loops that replace it elsewhere vectorise each dtype in its own way, so there only
    # the reference bound holds.
    context_lens = [1, 129, 1000, 40, 257, 16, 17, 300, 2][: len(query_lens)]
    q, kv, qsl = _varlen(13, query_lens, context_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16)
    rest = (kv.block_tables, qsl, kv.context_lens, 0.1, window, softcap)
    out = cpu_ext.paged_attention(q, kv.key_cache, kv.value_cache, *rest)
    wide = cpu_ext.paged_attention(q.float(), kv.key_cache.float(), kv.value_cache.float(), *rest)
    assert out.dtype == torch.bfloat16
    if cpu_ext.register_tiles() and cpu_ext.bf16_dot():
        moved = out != wide.to(torch.bfloat16)
        assert moved.float().mean() < 0.02  # few crossed a rounding boundary
        assert ((out.float() - wide).abs() <= 2.0**-7 * wide.abs() + 1e-6).all()  # by one step at most
    elif cpu_ext.register_tiles():
        assert torch.equal(out, wide.to(torch.bfloat16))
    reference = paged_prefill_attention_ref(q.float(), kv.key_cache.float(), kv.value_cache.float(), *rest)
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_match_reference(dtype):
    q, kv, qsl = _varlen(4, [1, 9, 30], [12, 9, 70], 6, 2, 64, 16, dtype)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.125)
    out = cpu_ext.paged_attention(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), paged_prefill_attention_ref(*args).float(), atol=1e-2, rtol=1e-2)


def test_strided_query_rows_are_read_in_place():
    q, kv, qsl = _varlen(6, [4, 1], [10, 3], 4, 2, 16, 4)
    wide = torch.cat([q, torch.randn_like(q)], dim=1)[:, :4]  # rows strided like a split qkv
    args = (kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.3)
    torch.testing.assert_close(cpu_ext.paged_attention(wide, *args), paged_prefill_attention_ref(q, *args))


def test_result_does_not_depend_on_thread_count():
    q, kv, qsl = _varlen(8, [1] * 5 + [50, 20], [9, 33, 1, 64, 5, 50, 90], 6, 3, 32, 16)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ext.paged_attention(*args)
        torch.set_num_threads(2)
        two = cpu_ext.paged_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_the_kernel_runs_on_all_of_torchs_threads():
    # at::parallel_for compiled without -fopenmp runs serially: the kernel once did, whatever
    # torch's thread count (and ran no faster on 2 threads than on 1)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.ops.pdserve_cpu.parallel_width() == threads
    finally:
        torch.set_num_threads(before)


def test_block_id_outside_the_cache_is_a_clear_error():
    q, kv, qsl = _varlen(2, [1], [5], 2, 1, 8, 4)
    tables = kv.block_tables.clone()
    tables[0, 1] = kv.key_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ext.paged_attention(q, kv.key_cache, kv.value_cache, tables, qsl, kv.context_lens, 0.5)


def test_int64_tables_are_refused():
    q, kv, qsl = _varlen(2, [1], [5], 2, 1, 8, 4)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ext.paged_attention(
            q, kv.key_cache, kv.value_cache, kv.block_tables.long(), qsl, kv.context_lens, 0.5
        )


def test_more_query_rows_than_context_is_a_clear_error():
    q, kv, _ = _varlen(2, [6], [5], 2, 1, 8, 4)
    qsl = query_start_loc([6])
    with pytest.raises(RuntimeError, match="more query rows than context"):
        cpu_ext.paged_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.5)


FALLBACK = """
import torch
from pdserve.kernels import ops, torch_fast
from pdserve.kernels.testing import random_paged_kv
kv = random_paged_kv([7, 20], 4, 2, 8)
q = torch.randn(2, 4, 8)
args = (q, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, 0.3)
assert not ops.native_cpu(q)
assert torch.equal(ops.paged_decode_attention(*args), torch_fast.paged_decode_attention(*args))
print("torch path")
"""


@pytest.mark.usefixtures("processes")
def test_without_a_compiler_the_torch_path_runs_after_one_warning(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "PDSERVE_CACHE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch path"
    assert out.stderr.count("no C++ compiler") == 1


@pytest.mark.usefixtures("processes")
def test_switched_off_the_torch_path_runs():
    env = {**os.environ, "PDSERVE_NATIVE_CPU": "0"}
    out = subprocess.run(
        [sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "warning" not in out.stderr.lower()


def test_torch_path_is_unchanged_by_the_switch():
    # backend="torch" always takes torch_fast, whatever the extension
    q, kv, qsl = _varlen(1, [3], [9], 4, 2, 8, 4)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 0.4)
    assert torch.equal(
        ops.paged_prefill_attention(*args, backend="torch"), torch_fast.paged_prefill_attention(*args)
    )
