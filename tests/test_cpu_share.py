"""The automatic torch thread count gives way to other processes (engine/machine/cpu_share.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.machine.cpu_share import CLOCK_TICKS, CpuShare, busy_seconds, threads_for
from pdserve.engine.machine.resources import usable_cpus
from tests.tiny_models import make_tiny_model

STAT = """cpu  900 0 300 5000 10 0 5 0 0 0
cpu0 100 0 50 2000 5 0 2 3 40 0
cpu1 800 0 250 3000 5 0 3 7 0 0
cpu2 1 1 1 1 1 1 1 1 0 0
intr 12345 0 0
ctxt 999
"""

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity")
    or usable_cpus() < 2
    or len(os.sched_getaffinity(0)) != usable_cpus()
    or not os.path.exists("/proc/stat"),
    reason="needs 2+ CPUs set by the affinity mask and /proc/stat",
)


def test_busy_time_counts_the_given_cpus_non_idle_fields_steal_included():
    # cpu0: user 100 + system 50 + softirq 2 + steal 3 (guest 40 is inside user already)
    assert busy_seconds({0}, STAT) == pytest.approx(155 / CLOCK_TICKS)
    assert busy_seconds({0, 1}, STAT) == pytest.approx((155 + 1060) / CLOCK_TICKS)
    assert busy_seconds({5}, STAT) == 0


@pytest.mark.parametrize(
    ("usable", "others", "ceiling", "threads"),
    [
        (2, 0.0, 2, 2),
        (2, 0.4, 2, 2),
        (2, 0.6, 2, 1),
        (2, 1.0, 2, 1),
        (2, 2.0, 2, 1),
        (8, 2.2, 8, 6),
        (8, 0, 4, 4),
    ],
)
def test_threads_leave_other_processes_their_share(usable, others, ceiling, threads):
    assert threads_for(usable, others, ceiling) == threads


@contextlib.contextmanager
def busy_neighbour(cpu: int):
    """A real CPU-bound process pinned to ``cpu``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _tick_until(share: CpuShare, done, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        share.tick()
        if done():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.usefixtures("processes")
@needs_two_cpus
def test_a_busy_neighbour_takes_a_thread_and_gives_it_back():
    applied: list[int] = []
    share = CpuShare(2, usable_cpus(), applied.append, interval=0.4)
    assert share.active
    with busy_neighbour(min(share.cpus)):
        assert _tick_until(share, lambda: applied == [1], 8), f"others {share.others:.2f}, applied {applied}"
        assert share.others > 0.6
    assert _tick_until(share, lambda: applied == [1, 2], 10), f"others {share.others:.2f}, applied {applied}"


def test_an_explicit_thread_count_or_one_cpu_never_adapts():
    assert not CpuShare(2, 2, print, enabled=False).active
    assert not CpuShare(1, 1, print).active
    assert not CpuShare(2, 2, print, stat_path="/nonexistent/stat").active


@pytest.mark.usefixtures("processes")
@needs_two_cpus
def test_the_engine_drops_to_one_thread_beside_a_busy_process_and_stays_exact():
    before = torch.get_num_threads()
    path = str(make_tiny_model("llama"))
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        fixed = LLM(path, max_num_seqs=4, kv_cache_memory_mb=16, num_threads=2)
        assert not fixed.engine.cpu_share.active
        want = [o.outputs[0].token_ids for o in fixed.generate(prompts, params)]
        llm = LLM(path, max_num_seqs=4, kv_cache_memory_mb=16)
        share = llm.engine.cpu_share
        assert share.active and torch.get_num_threads() == usable_cpus()
        share.interval = 0.3
        with busy_neighbour(min(share.cpus)):
            deadline = time.monotonic() + 20
            while torch.get_num_threads() != usable_cpus() - 1 and time.monotonic() < deadline:
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                assert got == want  # the thread count changes how fast, never what
        assert torch.get_num_threads() == usable_cpus() - 1, f"others {share.others:.2f}"
    finally:
        torch.set_num_threads(before)
