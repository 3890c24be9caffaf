"""Without a GPU, the Triton kernel tests run on CPU in Triton's interpreter, in a child process.

``TRITON_INTERPRET=1`` must be set before triton is first imported, and other test modules
in this process import it without the variable, so the kernel tests get a fresh interpreter.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

KERNEL_TESTS = pathlib.Path(__file__).with_name("test_kernels_triton.py")


@pytest.mark.usefixtures("processes")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the compiled kernels are tested directly")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="already interpreted in this process")
def test_triton_kernels_match_refs_in_the_cpu_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(KERNEL_TESTS)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0 and " passed" in summary, result.stdout[-6000:] + result.stderr[-3000:]
