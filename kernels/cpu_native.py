"""An experimental C kernel for CPU decode attention that reads the paged cache in place.

Opt-in with ``PDSERVE_NATIVE_CPU=1``: measured side by side it did not beat the torch path
(gather + SDPA on torch's thread pool) on this project's machines — single-threaded it is level,
and an OpenMP build fights torch's own OpenMP pool and loses badly (see bench/README.md). Built
once with the system C compiler into a per-user cache (keyed by the source and the CPU's flags),
loaded with ctypes; ``native_decode()`` is None when disabled or when it cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import torch

SOURCE = pathlib.Path(__file__).parent / "csrc" / "paged_decode_cpu.c"
# Reassociation lets the dot products vectorize. Never -ffast-math / -Ofast: a shared object built
# with them links crtfastmath, which turns on flush-to-zero for the whole process when loaded.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return pathlib.Path(base) / "native"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), os.uname().machine)
    except OSError:
        return os.uname().machine


def native_decode():
    """The ctypes function when enabled (PDSERVE_NATIVE_CPU=1) and buildable, else None."""
    return build() if os.environ.get("PDSERVE_NATIVE_CPU", "0") == "1" else None


@functools.cache
def build():
    """Build (once per source and CPU) and load the kernel; None without a working C compiler."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    # -march=native: the build is only valid for this CPU, so its flags are part of the key.
    key = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode() + " ".join(CFLAGS).encode()).hexdigest()[
        :16
    ]
    lib = _cache_dir() / f"paged_decode_cpu-{key}.so"
    if not lib.exists():
        if compiler is None:
            return None
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = pathlib.Path(tmp) / lib.name
            cmd = [compiler, *CFLAGS, str(SOURCE), "-o", str(out), "-lm"]
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                return None
            os.replace(out, lib)  # atomic: concurrent builders (node processes) all end with one file
    fn = ctypes.CDLL(str(lib)).paged_decode_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64, i64, ctypes.c_int]
    fn.restype = None
    return fn


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    fn=None,
) -> torch.Tensor | None:
    """Same contract as kernels.torch_fast.paged_decode_attention; None when not applicable.
    ``fn``: a built kernel to use regardless of PDSERVE_NATIVE_CPU (tests)."""
    fn = fn or native_decode()
    if fn is None or query.dtype != torch.float32 or key_cache.dtype != torch.float32:
        return None
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    assert key_cache.is_contiguous() and value_cache.is_contiguous(), "cache must be contiguous (nbhd-v1)"
    assert num_heads % num_kv_heads == 0 and value_cache.shape == key_cache.shape
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()  # [S, MAXB]
    lens = context_lens.to(torch.int32).contiguous()  # [S]
    out = torch.empty_like(query)
    max_context = int(lens.max()) if num_seqs else 0
    fn(
        query.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        sliding_window or 0,
        max_context,
        torch.get_num_threads(),
    )
    return out
