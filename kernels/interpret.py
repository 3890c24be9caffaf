"""Load the Triton kernel modules built for Triton's CPU interpreter (machines without a GPU).

``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *defined* (module import), not
when it launches. So this (re)imports the kernel modules with the variable set and then
restores it: afterwards ``backend="triton"`` runs on CPU tensors in this process, while the
environment of everything else (subprocesses, other tests) stays as it was. On a machine
with a GPU, do not call it: the compiled kernels are what should be tested there.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

KERNEL_MODULES = ("kernels.kv_write", "kernels.paged_decode", "kernels.paged_prefill",
                  "kernels.block_copy", "kernels.kv_quant")  # fmt: skip


def is_interpreted(module: ModuleType) -> bool:
    """True when the module's @triton.jit kernels were built for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return any(isinstance(value, InterpretedFunction) for value in vars(module).values())


def load_interpreted_kernels() -> list[ModuleType]:
    """Import every kernel module in interpreter mode (re-importing any built for a GPU)."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        modules = []
        for name in KERNEL_MODULES:
            module = sys.modules.get(name)
            if module is None:
                module = importlib.import_module(name)
            elif not is_interpreted(module):
                module = importlib.reload(module)
            modules.append(module)
        return modules
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
