"""Device names, and the choices that follow the device: the attention backend and the dtype.

The device itself, and everything that differs between devices, is engine/executor/platform.py's.
"""

from __future__ import annotations

import functools
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


@functools.cache
def cpu_computes_bf16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX), which oneDNN's matmuls use;
    elsewhere torch emulates bf16 with conversions, slower than float32. Read from /proc/cpuinfo
    (torch-free: `pdserve up` says what its nodes will pick), else asked of torch."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        import torch

        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device_type: str, checkpoint: str = "float32") -> str:
    """The dtype for ``--dtype``: an explicit name, or what ``auto`` picks (``explain_dtype``)."""
    return explain_dtype(name, device_type, checkpoint)[0]


def explain_dtype(name: str, device_type: str, checkpoint: str = "float32") -> tuple[str, str]:
    """``(dtype, why)`` for ``--dtype``. ``auto`` is bfloat16 on CUDA. On the CPU it follows the
    checkpoint (``ModelConfig.checkpoint_dtype``): a half-precision or quantized one runs in bfloat16
    where the CPU computes it natively, as vLLM's CPU backend does, about twice float32's speed
    (bench/notes/engine-cpu.md, "bfloat16"); a float32 checkpoint, or a CPU without bf16
    arithmetic, runs in float32."""
    if name != "auto":
        return name, "--dtype"
    if device_type == "cuda":
        return "bfloat16", "auto on CUDA"
    if checkpoint == "float32":
        return "float32", "auto: the checkpoint is float32"
    if not cpu_computes_bf16():
        return "float32", f"auto: the checkpoint is {checkpoint}, but this CPU has no AVX512-BF16 or AMX"
    return "bfloat16", f"auto: the checkpoint is {checkpoint} and this CPU computes bfloat16 natively"


def describe_dtype(dtype: torch.dtype, device: torch.device, why: str = "--dtype") -> str:
    """The start-up line's dtype and why it was chosen, with a hint where a float32 CPU engine
    leaves bf16 hardware idle."""
    import torch

    name = str(dtype).removeprefix("torch.")
    hint = ""
    if device.type == "cpu" and dtype == torch.float32 and cpu_computes_bf16():
        hint = "; this CPU has bf16 arithmetic: --dtype bfloat16 runs about 2x faster"
    return f"dtype {name} ({why}{hint})"


def describe_runtime(runner, device: torch.device, adapts_threads: bool, dtype_why: str = "--dtype") -> str:
    """The start-up line's account of how this engine computes: kernels, dtype, CPU settings."""
    from pdserve.engine.machine import cpu_env
    from pdserve.kernels import ops

    native = ops.native_cpu(runner.kv_caches[0][0], runner.attention_backend)
    attention = "C++ CPU kernel" if native else "torch/Triton"
    linear = "oneDNN, packed weights" if runner.packed_linear else "F.linear"
    if runner.quantization == "int8":
        linear = "oneDNN int8 (W8A8: int8 weights per channel, activations per token; LM head in dtype)"
    adapts = "; fewer torch threads while other processes load these CPUs" * adapts_threads
    dtype = describe_dtype(runner.dtype, device, dtype_why)
    return f"{adapts}; {dtype}; attention: {attention}; linear layers: {linear}; {cpu_env.describe()}"
