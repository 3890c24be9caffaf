"""GPU-only kernel checks: production shapes (head_dim 64/128, long contexts), fp16/bf16 tensor-core paths.

The compiled kernels are compared with torch_fast on the GPU (itself checked against the
references on CPU in test_kernels_reference.py), since the loop references are too slow here.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.ops import (
    dequantize_kv_int8,
    paged_decode_attention,
    paged_prefill_attention,
    quantize_kv_int8,
    torch_fast,
)
from pdserve.kernels.testing import query_start_loc, random_paged_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 4), (128, 8)])
def test_decode_long_contexts_match_torch_fast(dtype, head_dim, group):
    kv = random_paged_kv([1, 17, 600, 4100], 16, 2, head_dim, dtype=dtype, device="cuda")
    query = torch.randn(4, 2 * group, head_dim, device="cuda").to(dtype)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.context_lens, head_dim**-0.5)
    for window in (None, 1000):
        out = paged_decode_attention(*args, window)  # CUDA tensors: Triton
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out, torch_fast.paged_decode_attention(*args, window), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_chunks_match_torch_fast(dtype):
    context_lens, query_lens = [700, 300, 1, 2050], [700, 44, 1, 512]
    kv = random_paged_kv(context_lens, 16, 2, 128, dtype=dtype, device="cuda")
    query = torch.randn(sum(query_lens), 8, 128, device="cuda").to(dtype)
    qsl = query_start_loc(query_lens, device="cuda")
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.context_lens, 128**-0.5)
    for window in (None, 256):
        out = paged_prefill_attention(*args, window)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out, torch_fast.paged_prefill_attention(*args, window), atol=tol, rtol=tol)


def test_int8_round_trip_on_gpu_stays_within_half_a_step():
    x = torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    q, scales = quantize_kv_int8(x)
    q_cpu, scales_cpu = quantize_kv_int8(x.cpu())
    assert torch.equal(scales.cpu(), scales_cpu)
    assert int((q.cpu().int() - q_cpu.int()).abs().max()) <= 1  # GPU division may round 1 ulp apart
    restored = dequantize_kv_int8(q, scales, torch.float32)
    step = scales[:, None, :, None]
    assert bool(((restored - x.float()).abs() <= step * (0.5 + 1e-2 / 127)).all())
