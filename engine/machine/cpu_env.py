"""OpenMP's wait policy for this process: chosen before torch loads its OpenMP runtime.

libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, when torch is imported. Its default lets
idle threads spin for up to 300000 iterations before sleeping; beside another busy process on the
same cores a 2-thread engine then lost 3-4x (bench/notes/engine-cpu.md, "OpenMP waiting"). Sleeping at once
(PASSIVE) never collapses but pays a wake-up in each of a decode step's ~500 parallel regions:
20-30% of a quiet machine's speed. The engine's default spins briefly (GOMP_SPINCOUNT=10000, a few
microseconds: long enough to bridge the gap between one op's parallel region and the next), and
engine/machine/cpu_share.py drops to one thread, which has no barrier to wait at, while other processes
load the CPUs. The engine sets the variable only where neither is set, so an explicit choice
always wins. Torch-free.
"""

from __future__ import annotations

import os
import sys

DEFAULT_SPINCOUNT = "10000"
_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_set_here: list[str] = []  # the variables this process set (for the start-up line)


def apply_openmp_defaults(environ=os.environ) -> None:
    """Set GOMP_SPINCOUNT to the engine's default unless the environment already chose."""
    if not any(name in environ for name in _VARIABLES) and "torch" not in sys.modules:
        environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT
        _set_here.append("GOMP_SPINCOUNT")


def describe(environ=os.environ) -> str:
    """The policy in effect, for the start-up line."""
    chosen = [f"{name}={environ[name]}" for name in _VARIABLES if name in environ]
    if not chosen:
        return "OpenMP wait: libgomp default (torch loaded before the engine could set one)"
    source = "engine default" if _set_here else "environment"
    return f"OpenMP wait: {', '.join(chosen)} ({source})"
