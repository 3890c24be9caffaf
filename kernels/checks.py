"""Layout and dtype checks shared by the Triton wrappers, run before every launch."""

from __future__ import annotations

import torch

from pdserve.kernels.kv_int8 import SCALE_BYTES

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8)  # int8: rows with their scales (kernels/kv_int8.py)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_cache(cache: torch.Tensor, name: str = "cache") -> tuple[int, int, int, int]:
    """Assert a KV cache is [num_blocks, block_size, num_kv_heads, head_dim], contiguous, float."""
    assert cache.dim() == 4, (
        f"{name} must be [num_blocks, block_size, num_kv_heads, head_dim], got {cache.shape}"
    )
    assert cache.is_contiguous(), f"{name} must be contiguous (protocol/kv_layout.py)"
    assert cache.dtype in CACHE_DTYPES, f"{name} dtype {cache.dtype} not in {CACHE_DTYPES}"
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, head_dim: int) -> tuple[int, ...]:
    """Assert K and V caches match each other and the query's head_dim; return K's shape."""
    shape = check_cache(key_cache, "key_cache")
    check_cache(value_cache, "value_cache")
    assert value_cache.shape == key_cache.shape, (key_cache.shape, value_cache.shape)
    assert value_cache.dtype == key_cache.dtype, (key_cache.dtype, value_cache.dtype)
    assert value_cache.device == key_cache.device, (key_cache.device, value_cache.device)
    width = head_dim + (SCALE_BYTES if key_cache.dtype == torch.int8 else 0)
    assert shape[3] == width, f"cache rows of {shape[3]} != {width} for query head_dim {head_dim}"
    return shape


def check_index_tensor(t: torch.Tensor, name: str, device: torch.device) -> None:
    """Assert an integer index tensor (block ids, lengths, slots) is on the kernel's ``device``
    (a host index beside device caches would otherwise fail inside Triton) and has a unit last
    stride."""
    assert t.device == device, f"{name} is on {t.device}, the kernel's tensors on {device}"
    assert t.dtype in INDEX_DTYPES, f"{name} must be int32 or int64, got {t.dtype}"
    assert t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1, f"{name} needs a unit last stride"
