"""Busy neighbours for a calibration: processes that keep a core each busy with matmuls, as the other
nodes of a one-host cluster do while this one works (they share caches and memory bandwidth)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator


def _spin(stop) -> None:
    import torch

    torch.set_num_threads(1)
    a = torch.randn(576, 1536)  # a default-model MLP matmul over a 576-token chunk
    b = torch.randn(1536, 576)
    while not stop.is_set():
        a @ b


@contextlib.contextmanager
def neighbours(num: int) -> Iterator[None]:
    """``num`` busy processes for the duration of the block (none when num is 0)."""
    if num <= 0:
        yield
        return
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(num)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(10)
