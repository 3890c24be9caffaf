"""The command lines of pdserve's own processes, built in one place: the launcher, the bench
scripts and the tests start nodes, routers and clusters the same way (torch-free)."""

from __future__ import annotations

import pathlib
import sys


def pdserve_argv(*args: str) -> list[str]:
    """``pdserve ARGS`` with this interpreter (a checkout need not be installed)."""
    return [sys.executable, "-m", "pdserve", *args]


def up_argv(
    port: int, log_dir: str | pathlib.Path, *flags: str, model: str | pathlib.Path | None = None
) -> list[str]:
    """``pdserve up`` on ``port`` with its logs in ``log_dir``; no model: the default model."""
    model_flags = ["--model", str(model)] if model is not None else []
    return pdserve_argv("up", *model_flags, "--port", str(port), "--log-dir", str(log_dir), *flags)
