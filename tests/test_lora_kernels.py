"""Batched LoRA on random shapes: the CPU path of engine/lora/compute.py (rows grouped by slot) and
the Triton shrink / expand of kernels/lora_triton.py, each against the per-row torch reference.

The Triton cases run compiled on a CUDA machine; without one, the last test re-runs this module
in a child process under TRITON_INTERPRET=1 (it must be set before triton is first imported, as in
tests/test_kernels_triton.py). Sizes stay tiny for the interpreter. Slot ``S`` (one past the
last) marks base-model rows, which must come out untouched."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from pdserve.engine.lora.compute import LoRABatch, StackedPart, lora_add_, token_slots_of

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = torch.cuda.is_available() and not INTERPRETED
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
needs_triton = pytest.mark.skipif(
    not (ON_GPU or INTERPRETED), reason="no GPU: run under TRITON_INTERPRET=1 by the interpreter test below"
)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# name -> (rows T, in features, max rank R, slots S, each part's output rows)
CASES = {
    "one-part": (7, 64, 4, 3, [48]),
    "qkv-parts-odd-in": (13, 40, 8, 4, [32, 16, 16]),
    "in-past-one-block-rank-past-one-block": (5, 200, 24, 2, [20, 36]),
    "one-row": (1, 16, 16, 1, [70]),
}


def _case(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """x [T, in], a [S, P*R, in] (each part's rank zero-padded), parts, and slots [T] with base rows."""
    num_tokens, in_features, rank, num_slots, outs = CASES[name]
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, len(outs) * rank, in_features, generator=g)
    for s in range(num_slots):  # slot s uses rank - s of the R rows: the padding is zeros
        for p in range(len(outs)):
            a[s, p * rank + max(1, rank - s) : (p + 1) * rank] = 0
    ats = np.cumsum([0, *outs])
    parts = [
        StackedPart(
            torch.randn(num_slots, n, rank, generator=g).to(dtype), slice(int(ats[p]), int(ats[p + 1]))
        )
        for p, n in enumerate(outs)
    ]
    slots = torch.randint(0, num_slots + 1, (num_tokens,), generator=g).numpy()
    slots[-1] = 0  # an adapter row, and (with more than one row) a base row
    if num_tokens > 1:
        slots[0] = num_slots
    x = torch.randn(num_tokens, in_features, generator=g).to(dtype)
    y = torch.randn(num_tokens, int(ats[-1]), generator=g).to(dtype)
    return x, a.to(dtype), parts, slots, y


def _reference(x, a, parts, slots, y) -> torch.Tensor:
    from pdserve.kernels.lora_triton import lora_expand_ref, lora_shrink_ref

    out, token_slots = y.clone(), torch.from_numpy(slots)
    h = lora_shrink_ref(x, a, token_slots)
    rank = parts[0].b.shape[2]
    for p, part in enumerate(parts):
        view = out[:, part.rows]
        lora_expand_ref(h[:, p * rank : (p + 1) * rank], part.b, token_slots, view)
    return out


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("name", CASES)
def test_grouped_torch_path_matches_the_per_row_reference(name):
    x, a, parts, slots, y = _case(name)
    want = _reference(x, a, parts, slots, y)
    batch = LoRABatch.build(slots, a.shape[0], torch.device("cpu"), backend="torch")
    assert batch is not None
    got = y.clone()
    lora_add_(got, x, a, parts, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base = slots == a.shape[0]
    assert torch.equal(got[base], y[base])  # base rows untouched, bit for bit


def test_a_batch_groups_rows_by_slot_and_is_none_without_adapter_rows():
    slots = token_slots_of([2, None, 0, 2], [3, 1, 2, 1], num_slots=3)
    assert slots.tolist() == [2, 2, 2, 3, 0, 0, 2]
    batch = LoRABatch.build(slots, 3, torch.device("cpu"))
    assert batch is not None
    assert [(s, rows.tolist()) for s, rows in batch.slot_rows] == [(0, [4, 5]), (2, [0, 1, 2, 6])]
    assert batch.token_slots.dtype == torch.int32 and batch.token_slots.tolist() == slots.tolist()
    assert LoRABatch.build(token_slots_of([None, None], [4, 1], 3), 3, torch.device("cpu")) is None


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_triton_shrink_and_expand_match_the_per_row_reference(name, dtype):
    from pdserve.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

    x, a, parts, slots, y = _case(name, dtype)
    want = _reference(x, a, parts, slots, y)
    xd, ad, yd = _on(DEVICE, x, a, y)
    token_slots = torch.from_numpy(slots.astype(np.int32)).to(DEVICE)
    h = torch.full((x.shape[0], a.shape[1]), float("nan"), dtype=dtype, device=DEVICE)  # unwritten: fails
    lora_shrink_triton(xd, ad, token_slots, h)
    torch.testing.assert_close(
        h.cpu(), _shrink_ref(x, a, slots), atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype]
    )
    rank = parts[0].b.shape[2]
    for p, part in enumerate(parts):  # y's parts: column slices, rows strided
        lora_expand_triton(h[:, p * rank : (p + 1) * rank], part.b.to(DEVICE), token_slots, yd[:, part.rows])
    scale = want.abs().max().item()
    torch.testing.assert_close(yd.cpu(), want, atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype])
    base = slots == a.shape[0]
    assert torch.equal(yd.cpu()[base], y[base])


def _shrink_ref(x, a, slots):
    from pdserve.kernels.lora_triton import lora_shrink_ref

    return lora_shrink_ref(x, a, torch.from_numpy(slots))


@needs_triton
@pytest.mark.parametrize("name", CASES)
def test_lora_add_on_triton_matches_the_grouped_torch_path(name):
    x, a, parts, slots, y = _case(name, seed=7)
    grouped = y.clone()
    lora_add_(grouped, x, a, parts, LoRABatch.build(slots, a.shape[0], torch.device("cpu"), "torch"))
    xd, ad, yd = _on(DEVICE, x, a, y)
    dparts = [StackedPart(p.b.to(DEVICE), p.rows) for p in parts]
    lora_add_(yd, xd, ad, dparts, LoRABatch.build(slots, a.shape[0], DEVICE, "triton"))
    torch.testing.assert_close(yd.cpu(), grouped, atol=1e-4, rtol=1e-5)


@pytest.mark.usefixtures("processes")
@pytest.mark.skipif(ON_GPU, reason="with a GPU the compiled kernels are tested directly")
@pytest.mark.skipif(INTERPRETED, reason="already interpreted in this process")
def test_triton_lora_kernels_match_the_reference_in_the_cpu_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = str(pathlib.Path(__file__))
    only = "triton and not interpreter"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", here, "-k", only]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary and "skipped" not in summary, (
        result.stdout[-6000:] + result.stderr[-3000:]
    )
