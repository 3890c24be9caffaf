"""The experimental C decode-attention kernel for CPU against the pure-torch reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import cpu_native
from kernels.paged_decode import paged_decode_attention_ref


@pytest.fixture(scope="module")
def kernel():
    fn = cpu_native.build()  # opt-in for the engine; built here whatever PDSERVE_NATIVE_CPU says
    assert fn is not None, "the C kernel could not be built: is a C compiler installed?"
    return fn


def _case(seed, num_seqs, num_heads, num_kv_heads, head_dim, block_size, lens):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = num_seqs * max_blocks + 3
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    return q, kc, vc, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("window", [None, 5])
def test_native_decode_matches_reference(kernel, block_size, num_heads, num_kv_heads, window):
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 2]  # one token, exact and mid-block ends
    q, kc, vc, tables, ctx = _case(7, len(lens), num_heads, num_kv_heads, 16, block_size, lens)
    out = cpu_native.paged_decode_attention(q, kc, vc, tables, ctx, 0.25, window, fn=kernel)
    ref = paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.25, window)
    assert out is not None and (out - ref).abs().max().item() < 1e-5


def test_native_decode_declines_other_dtypes(kernel):
    q, kc, vc, tables, ctx = _case(1, 2, 4, 2, 8, 8, [3, 9])
    half = cpu_native.paged_decode_attention(
        q.half(), kc.half(), vc.half(), tables, ctx, 0.3, None, fn=kernel
    )
    assert half is None


def test_native_kernel_is_off_unless_asked_for():
    code = "from kernels import cpu_native; print(cpu_native.native_decode())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert out.stdout.strip() == "None"


def test_loading_the_kernel_keeps_subnormal_floats(kernel):
    # A library built with -ffast-math would switch on flush-to-zero for this whole process.
    import numpy as np

    tiny = np.float32(1e-40)
    assert tiny != 0 and np.float32(1e-39) * np.float32(0.1) != 0
