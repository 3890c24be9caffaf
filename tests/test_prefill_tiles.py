"""The prefill kernel's tiles and pipeline stages (kernels/paged_prefill.py, prefill_tiles) fit in an
H100's shared memory for every head size and dtype a supported family uses; checked on the CPU
(the arithmetic, not a compile: bench/gpu_oneshot.sh compiles the head_dim-256 case on a GPU)."""

from __future__ import annotations

import pytest

from pdserve.kernels.paged_prefill import SMEM_BUDGET, PrefillTiles, prefill_tiles

HEAD_DIMS = (64, 80, 96, 128, 256)  # SmolLM/GPT-2, StableLM, Phi-3, Llama/Qwen/Mixtral, Gemma
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPE_BYTES)
def test_every_supported_head_size_and_dtype_fits_in_shared_memory(head_dim, dtype):
    width = DTYPE_BYTES[dtype]
    tiles = prefill_tiles(head_dim, width, width)
    pad = max(16, 1 << (head_dim - 1).bit_length())
    assert tiles.smem_bytes(pad, width, width) <= SMEM_BUDGET
    assert (tiles.block_m, tiles.block_n) == (64, 64)  # stages alone make room at these sizes


@pytest.mark.parametrize(
    ("head_dim", "width", "stages"),
    [
        (128, 2, 3),  # 112 KB: Triton's default stays
        (256, 2, 2),  # 224 KB at 3 (the Gemma case): 160 KB at 2
        (128, 4, 2),  # fp32 Llama: 224 KB at 3, 160 KB at 2
        (256, 4, 1),  # fp32 Gemma: 192 KB at 1
    ],
)
def test_the_stages_are_the_most_that_fit(head_dim, width, stages):
    assert prefill_tiles(head_dim, width, width) == PrefillTiles(64, 64, stages)


def test_the_arithmetic_is_the_query_tile_plus_a_k_and_v_tile_per_stage():
    assert PrefillTiles(64, 64, 3).smem_bytes(256, 2, 2) == 224 * 1024
    assert PrefillTiles(64, 32, 2).smem_bytes(128, 2, 1) == 64 * 128 * 2 + 2 * 2 * 32 * 128


def test_a_head_too_wide_for_one_stage_narrows_the_key_tile_first():
    tiles = prefill_tiles(512, 4, 4)  # no family has it: 64 x 512 fp32 tiles are 128 KB each
    assert tiles.num_stages >= 1 and tiles.block_n < 64
    assert tiles.smem_bytes(512, 4, 4) <= SMEM_BUDGET
