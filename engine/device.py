"""Device names, and the choices that follow the device: the attention backend and the dtype.

The device itself, and everything that differs between devices, is engine/platform.py's.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device_name(name: str) -> None:
    if not DEVICE_RE.match(name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")


def resolve_attention_backend(name: str, device: torch.device) -> str | None:
    """The kernels' ``backend`` argument for ``--attention-backend``: None lets them pick by device
    (Triton on CUDA tensors, the CPU path on CPU ones). ``triton`` on the CPU runs Triton's
    interpreter, which must be switched on before triton is first imported in the process."""
    if name == "auto":
        return None
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise ValueError(
                "attention_backend triton on the CPU needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before the process starts (triton is already imported here)"
            )
        os.environ["TRITON_INTERPRET"] = "1"
        log.warning(
            "attention backend triton on the CPU: Triton's interpreter (slow; for testing the GPU path)"
        )
    return name


def resolve_dtype(name: str, device: torch.device) -> str:
    """The dtype for ``--dtype``: ``auto`` follows the device (bfloat16 on CUDA, float32 on the CPU,
    where output is checked token for token against HF in fp32)."""
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cuda" else "float32"


def describe_dtype(dtype: torch.dtype, device: torch.device) -> str:
    """The start-up line's dtype, with a hint where an fp32 CPU engine leaves bf16 hardware idle:
    with AVX512-BF16, oneDNN's bf16 matmuls run about twice as fast (bench/notes/engine-cpu.md, "bfloat16")."""
    import torch

    name = str(dtype).removeprefix("torch.")
    if device.type == "cpu" and dtype == torch.float32 and torch.cpu._is_avx512_bf16_supported():
        return f"dtype {name} (this CPU has AVX512-BF16: --dtype bfloat16 runs about 2x faster)"
    return f"dtype {name}"


def describe_runtime(runner, device: torch.device, adapts_threads: bool) -> str:
    """The start-up line's account of how this engine computes: kernels, dtype, CPU settings."""
    from pdserve.engine import cpu_env
    from pdserve.kernels import ops

    native = ops.native_cpu(runner.kv_caches[0][0], runner.attention_backend)
    attention = "C++ CPU kernel" if native else "torch/Triton"
    linear = "oneDNN, packed weights" if runner.packed_linear else "F.linear"
    adapts = "; fewer torch threads while other processes load these CPUs" * adapts_threads
    dtype = describe_dtype(runner.dtype, device)
    return f"{adapts}; {dtype}; attention: {attention}; linear layers: {linear}; {cpu_env.describe()}"
