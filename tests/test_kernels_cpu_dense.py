"""The CPU dense ops (kernels/csrc/dense_cpu.cpp) against the layers' own torch paths."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.layers.mlp import GatedMLP
from pdserve.engine.layers.norms import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.kernels import cpu_ext

ROPE = {"rope_type": "default", "rope_theta": 10000.0}
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2}}


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_ext.load() is not None, "the extension could not be built: is a C++ compiler installed?"


def _torch_path(monkeypatch, fn):
    monkeypatch.setenv("PDSERVE_NATIVE_CPU", "0")
    try:
        return fn()
    finally:
        monkeypatch.delenv("PDSERVE_NATIVE_CPU")


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 5, 300])
def test_rms_norm_matches_the_torch_path(monkeypatch, dtype, unit_offset, rows):
    norm = RMSNorm(96, 1e-6, unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(96, seed=1))
    x = _randn(rows, 96, seed=2, dtype=dtype) * 3
    with torch.inference_mode():
        got = norm(x)
        want = _torch_path(monkeypatch, lambda: norm(x))
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_takes_per_head_and_strided_inputs(monkeypatch):
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(_randn(32, seed=3))
    heads = _randn(7, 10, 32, seed=4)[:, 2:6]  # [T, 4 heads, D], a strided view as q of a qkv split
    rows = _randn(7, 64, seed=5)[:, ::2]  # no contiguous last dim: reshaped first
    with torch.inference_mode():
        for x in (heads, rows):
            torch.testing.assert_close(
                norm(x), _torch_path(monkeypatch, lambda x=x: norm(x)), rtol=1e-5, atol=1e-5
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_and_norm_updates_the_residual_in_place(monkeypatch, dtype):
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(64, seed=6))
    residual, x = _randn(33, 64, seed=7, dtype=dtype), _randn(33, 64, seed=8, dtype=dtype)
    with torch.inference_mode():
        res_native, res_torch = residual.clone(), residual.clone()
        got = norm.add_and_norm_(x, res_native)
        want = _torch_path(monkeypatch, lambda: norm.add_and_norm_(x, res_torch))
    assert torch.equal(res_native, residual + x)  # one rounding of the sum, as torch's add
    assert torch.equal(res_torch, residual + x)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 40])
def test_silu_mul_matches_the_torch_mlp(monkeypatch, dtype, rows):
    mlp = GatedMLP(48, 80, "silu").to(dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(_randn(*p.shape, seed=p.numel()) * 0.5)
    x = _randn(rows, 48, seed=9, dtype=dtype) * 4  # gates far into both tails of the sigmoid
    with torch.inference_mode():
        got = mlp(x)
        want = _torch_path(monkeypatch, lambda: mlp(x))
    # the outputs are sums of 80 products of size ~100: rounding scales with the largest of them
    scale = want.abs().max().item() if rows else 1.0
    torch.testing.assert_close(got, want, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale)


def test_silu_mul_is_exact_enough_at_the_extremes():
    gate = torch.tensor([[-200.0, -88.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.0, 200.0]])
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=1)
    got = cpu_ext.silu_mul(gate_up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate), rtol=2e-7, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_forward(dtype):
    rope = RotaryEmbedding(64, 512, ROPE, 512)
    qkv = _randn(9, 5, 64, seed=10, dtype=dtype)  # [T, 3 q/k heads + 2 v heads, D]
    qk = qkv[:, :3]  # strided rows, packed heads: the layer's q and k side by side
    positions = torch.tensor([0, 1, 2, 100, 7, 511, 3, 3, 64])
    want = rope(positions, qk.clone())
    assert rope.can_rotate_in_place(qk)
    v_before = qkv[:, 3:].clone()
    rope.rotate_(positions, qk)
    torch.testing.assert_close(qk, want, **TOL[dtype])
    assert torch.equal(qkv[:, 3:], v_before)  # nothing outside the view is touched


def test_rotary_refuses_what_it_cannot_rotate():
    partial = RotaryEmbedding(32, 64, ROPE, 64)  # rotates half of each 64-wide head
    assert not partial.can_rotate_in_place(torch.zeros(2, 3, 64))
    rope = RotaryEmbedding(64, 64, ROPE, 64)
    assert not rope.can_rotate_in_place(torch.zeros(2, 3, 128)[..., ::2])  # D not contiguous
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rope.rotate_(torch.tensor([0, 64]), torch.zeros(2, 3, 64))


@pytest.mark.parametrize("n", [1, 7, 16, 17, 33, 1000, 49152])
def test_argmax_rows_is_torchs_argmax_ties_nans_and_infinities_too(n):
    gen = torch.Generator().manual_seed(n)
    cases = {
        "random": torch.randn(5, n, generator=gen),
        "ties": torch.randint(0, 3, (5, n), generator=gen).float(),  # many equal maxima: the first wins
        "all -inf": torch.full((2, n), float("-inf")),
        "signed zeros": torch.zeros(3, n).index_fill_(1, torch.arange(0, n, 2), -0.0),
    }
    if n > 2:
        nans = torch.randn(4, n, generator=gen)
        nans[0, n // 2] = nans[1, n - 1] = nans[2, 1] = nans[2, n - 2] = float("nan")  # a NaN beats any value
        nans[3, n // 3] = float("inf")
        cases["nans and inf"] = nans
    for name, x in cases.items():
        assert torch.equal(cpu_ext.argmax_rows(x), x.argmax(dim=-1)), name
    wide = torch.randn(6, n + 5, generator=gen)[:, 2 : 2 + n]  # rows with a stride of their own
    assert torch.equal(cpu_ext.argmax_rows(wide), wide.argmax(dim=-1))
    assert cpu_ext.argmax_rows(torch.randn(0, n)).shape == (0,)


def test_argmax_rows_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_ext.argmax_rows(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="unit column stride"):
        cpu_ext.argmax_rows(torch.randn(8, 3).t())
    with pytest.raises(RuntimeError, match="n > 0"):
        cpu_ext.argmax_rows(torch.randn(3, 0))
