"""The CPU paged-attention kernel (kernels/csrc/paged_attention_cpu.cpp) as a torch C++ extension.

It reads the paged cache in place and runs in torch's own thread pool (at::parallel_for), so it
shares the cores with the matmuls instead of fighting them. Built once per machine with
``torch.utils.cpp_extension`` into the cache directory, keyed by the source, the build flags, the
torch version and the CPU's flags (``-march=native``); later processes load the built library
without invoking the compiler. On by default; ``PDSERVE_NATIVE_CPU=0`` turns it off, and where no
C++ compiler exists (or the build fails) the torch path runs, after one warning line.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import shutil
import time

import torch

log = logging.getLogger(__name__)

CSRC = pathlib.Path(__file__).parent / "csrc"
SOURCES = (  # one library, op namespace pdserve_cpu
    CSRC / "paged_attention_cpu.cpp",
    CSRC / "dense_cpu.cpp",
    CSRC / "kv_copy_cpu.cpp",
)
HEADERS = (
    CSRC / "cpu_math.h",
    CSRC / "paged_attention_common.h",
    CSRC / "paged_attention_decode.h",
    CSRC / "paged_attention_avx2.h",
    CSRC / "paged_attention_tiles.h",
)
NAME = "pdserve_paged_attention_cpu"
# Reassociation lets the dot products vectorize. Never -ffast-math / -Ofast: a shared object built
# with them may turn on flush-to-zero for the whole process when loaded.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    # at::parallel_for is a header template that runs in parallel only where _OPENMP is defined:
    # without -fopenmp the kernel ran on one thread whatever torch's thread count. Linked with
    # -fopenmp, the library needs libgomp.so.1, which resolves to the copy torch already loaded
    # (same soname), so there is one OpenMP pool in the process.
    "-fopenmp",
)
LDFLAGS = ("-fopenmp",)


def enabled() -> bool:
    """The kernel is wanted (PDSERVE_NATIVE_CPU is not 0) and loads; builds it on first call."""
    return os.environ.get("PDSERVE_NATIVE_CPU", "1") != "0" and load() is not None


def cache_dir() -> pathlib.Path:
    base = os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return pathlib.Path(base) / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), os.uname().machine)
    except OSError:
        return os.uname().machine


def build_key() -> str:
    parts = [
        *(path.read_bytes() for path in SOURCES + HEADERS),
        " ".join(CFLAGS + LDFLAGS).encode(),
        torch.__version__.encode(),
        _cpu_flags().encode(),
    ]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


@functools.cache
def load() -> pathlib.Path | None:
    """Build (once per key) and load the extension; its library path, or None after a warning."""
    build_dir = cache_dir() / f"{NAME}-{build_key()}"
    lib = build_dir / f"{NAME}.so"
    try:
        if lib.is_file():
            torch.ops.load_library(str(lib))
            return lib
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            log.warning("CPU paged attention: no C++ compiler (%s); using the torch path", compiler)
            return None
        build_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        from torch.utils import cpp_extension

        # Locks build_dir while it builds, so node processes starting together build it once.
        cpp_extension.load(
            name=NAME,
            sources=[str(path) for path in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        log.info("CPU paged attention: built %s in %.1f s", lib, time.perf_counter() - start)
        return lib
    except Exception as e:  # noqa: BLE001 - any build or load failure means the torch path
        log.warning(
            "CPU paged attention unavailable (%s); using the torch path", str(e).splitlines()[0][:200]
        )
        return None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Varlen causal attention of every sequence's new rows over its paged context, in one call.

    query: [T, H, D]; caches: [num_blocks, block_size, KVH, D] (nbhd-v1); block_tables: [S, MAXB]
    int32; query_start_loc: [S + 1] int32 (sequence s owns rows start[s]:start[s+1], its last
    positions); context_lens: [S] int32, new tokens included (their K/V already written).
    Decodes are sequences of one row. Builds the kernel on first use; raises where it cannot.
    """
    if load() is None:
        raise RuntimeError("the CPU paged-attention extension could not be built or loaded")
    return torch.ops.pdserve_cpu.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        sliding_window or 0,
        softcap or 0.0,
    )


def register_tiles() -> bool:
    """Whether the kernel was built with its register-tiled paths (AVX-512 machines only)."""
    if load() is None:
        raise RuntimeError("the CPU paged-attention extension could not be built or loaded")
    return bool(torch.ops.pdserve_cpu.register_tiles())


def bf16_dot() -> bool:
    """Whether a bf16 cache's decode scores come from bf16 dot products (vdpbf16ps: AVX512-BF16
    machines), rather than from keys widened to fp32 (kernels/csrc/paged_attention_decode.h)."""
    if load() is None:
        raise RuntimeError("the CPU paged-attention extension could not be built or loaded")
    return bool(torch.ops.pdserve_cpu.bf16_dot())


# The dense per-layer ops (kernels/csrc/dense_cpu.cpp). The layers call them on CPU tensors
# when ``enabled()``; each replaces several torch ops that each pass over the whole activation.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """[rows, dim] -> [rows, dim]: Llama's w * dtype(x / rms(x)), or Gemma's dtype(x / rms(x) * (1 + w))."""
    return torch.ops.pdserve_cpu.rms_norm(x, weight, eps, unit_offset)


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool
) -> torch.Tensor:
    """residual += x in place (contiguous [rows, dim]), then rms_norm(residual)."""
    return torch.ops.pdserve_cpu.add_rms_norm_(x, residual, weight, eps, unit_offset)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2I] -> [rows, I]: silu(gate) * up, gate being the first I columns."""
    return torch.ops.pdserve_cpu.silu_mul(gate_up)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place on [T, heads, D]: x * cos + rotate_half(x) * sin, rows of cos/sin ([P, D] fp32) by position."""
    torch.ops.pdserve_cpu.rotary_(x, positions, cos, sin)


def write_kv_int8_(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """New tokens' K/V [T, KVH, D] into their slots of int8 caches (slot -1: nowhere), the same
    bytes as the torch path (``kernels.torch_fast.write_kv_cache``)."""
    torch.ops.pdserve_cpu.write_kv_int8_(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks_xxh3(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor | None,
    dst_v: torch.Tensor | None,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor | None,
) -> int:
    """Blocks ``src_ids`` of src_k and src_v ([blocks, block_bytes] uint8) into blocks ``dst_ids``
    of dst_k and dst_v (None: checksum only), in one pass; returns xxhash's xxh3_64 intdigest of
    the K blocks then the V blocks in ``src_ids`` order. Needs block_bytes a multiple of 64 and
    the stream over 240 bytes (``xxh3_streams``). Runs without the GIL."""
    empty = src_k.new_empty((0, 0))
    digest = torch.ops.pdserve_cpu.copy_blocks_xxh3(
        src_k,
        src_v,
        empty if dst_k is None else dst_k,
        empty if dst_v is None else dst_v,
        src_ids,
        src_ids.new_empty(0) if dst_ids is None else dst_ids,
    )
    return digest & 0xFFFF_FFFF_FFFF_FFFF  # the op returns it as a signed int64


def xxh3_streams(block_bytes: int, num_blocks: int) -> bool:
    """Whether copy_blocks_xxh3 takes a layer of ``num_blocks`` blocks of ``block_bytes`` each."""
    return block_bytes % 64 == 0 and 2 * num_blocks * block_bytes > 240


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, n] fp32 (unit column stride) -> [rows] int64, exactly torch.argmax(x, dim=-1): the
    first maximum, a NaN counting as the maximum. One vectorised pass a row, rows in parallel."""
    return torch.ops.pdserve_cpu.argmax_rows(x)


def quantize_rows_u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, K] -> (uint8 [rows, K], fp32 [rows, 1]): each row's symmetric int8 (scale max|x| / 127,
    round half to even, clamped to +-127) plus 128; the same bytes as kernels/cpu_int8's torch path."""
    q, scale = torch.ops.pdserve_cpu.quantize_rows_u8(x)
    return q, scale


def dequantize_rows(
    acc: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """[rows, N] fp32 times each row's scale, plus bias [N], rounded once to ``dtype``."""
    return torch.ops.pdserve_cpu.dequantize_rows(acc, scale, bias, dtype)
