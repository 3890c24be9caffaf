"""OpenMP's wait policy for this process: chosen before torch loads its OpenMP runtime.

libgomp reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, when torch is imported. By default its idle
threads spin for a while before sleeping; beside another busy process on the same cores the
spinning thread takes the time the working one needs, and a 2-thread engine lost 3-4x
(bench/README.md, "OpenMP waiting"). PASSIVE makes idle threads sleep at once. The engine sets
it only where neither variable is set, so an explicit choice always wins. Torch-free.
"""

from __future__ import annotations

import os
import sys

DEFAULT_WAIT_POLICY = "PASSIVE"
_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_set_here: list[str] = []  # the variables this process set (for the start-up line)


def apply_openmp_defaults(environ=os.environ) -> None:
    """Set OMP_WAIT_POLICY to the engine's default unless the environment already chose."""
    if not any(name in environ for name in _VARIABLES) and "torch" not in sys.modules:
        environ["OMP_WAIT_POLICY"] = DEFAULT_WAIT_POLICY
        _set_here.append("OMP_WAIT_POLICY")


def describe(environ=os.environ) -> str:
    """The policy in effect, for the start-up line."""
    chosen = [f"{name}={environ[name]}" for name in _VARIABLES if name in environ]
    if not chosen:
        return "OpenMP wait: libgomp default (torch loaded before the engine could set one)"
    source = "engine default" if _set_here else "environment"
    return f"OpenMP wait: {', '.join(chosen)} ({source})"
