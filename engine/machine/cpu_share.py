"""The engine's torch thread count, following how much of its CPUs other processes take.

With libgomp's idle threads spinning a little between parallel regions (the engine's default,
engine/machine/cpu_env.py), a 2-thread engine on 2 idle cores runs 20-30% faster than with sleeping
threads: a decode step is ~500 parallel regions, and waking a sleeping thread for each costs tens
of microseconds. Beside a busy process the same setting collapses (to a quarter, bench/notes/engine-cpu.md
"OpenMP waiting"): every region waits at its barrier for a thread the busy process has
descheduled. One thread has no barrier to wait at and keeps nearly all its speed. So:

    others = (busy time of our CPUs - this process's CPU time) / wall time     (in cores)
    threads = clamp(round(usable CPUs - others), 1, the configured count)

measured over windows of ``interval`` seconds of engine steps (/proc/stat's per-CPU counters of
the CPUs this process may use, steal time included), and changed only when two windows in a row
agree. Only the automatic thread count adapts: an explicit ``num_threads`` is kept as given.
Linux only (elsewhere the count stays fixed). Torch-free: ``apply`` is the caller's setter.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds(cpus: set[int], stat_text: str) -> float:
    """Seconds the given CPUs spent not idle (user, nice, system, irq, softirq, steal)."""
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()]
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
        ticks += sum(fields[:3]) + sum(fields[5:8])
    return ticks / CLOCK_TICKS


def threads_for(usable: int, others: float, ceiling: int) -> int:
    """The thread count that leaves other processes' share of ``usable`` CPUs to them."""
    return max(1, min(ceiling, math.floor(usable - others + 0.5)))


@dataclasses.dataclass(slots=True)
class _Sample:
    wall: float
    busy: float
    own: float


class CpuShare:
    """Call ``tick()`` once per engine step; it calls ``apply(n)`` when the count should change."""

    def __init__(
        self,
        ceiling: int,
        usable: int,
        apply: Callable[[int], None],
        interval: float = 0.5,
        stat_path: str = "/proc/stat",
        enabled: bool = True,
    ) -> None:
        """ceiling: the automatic thread count; usable: the CPUs this process may use
        (engine.resources.usable_cpus). Where a cgroup quota, not the affinity mask, sets
        ``usable``, the per-CPU counters cover CPUs the quota shares with others, and the count
        stays fixed."""
        self.ceiling = self.threads = ceiling
        self.apply, self.interval, self.stat_path = apply, interval, stat_path
        try:
            self.cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = set()
        self.usable = usable
        self.others = 0.0  # other processes' cores over the last window
        self.changes = 0
        self._pending: int | None = None
        measurable = enabled and bool(self.cpus) and len(self.cpus) == usable and ceiling > 1
        self._last = self._sample() if measurable else None

    @property
    def active(self) -> bool:
        return self._last is not None

    def _sample(self) -> _Sample | None:
        try:
            with open(self.stat_path) as f:
                busy = busy_seconds(self.cpus, f.read())
        except (OSError, ValueError):
            return None
        t = os.times()
        return _Sample(time.monotonic(), busy, t.user + t.system)

    def tick(self) -> None:
        last = self._last
        if last is None or time.monotonic() - last.wall < self.interval:
            return
        now = self._sample()
        if now is None:
            return
        wall = now.wall - last.wall
        self.others = max(0.0, (now.busy - last.busy) - (now.own - last.own)) / wall
        self._last = now
        target = threads_for(self.usable, self.others, self.ceiling)
        if target == self.threads:
            self._pending = None
        elif target == self._pending:  # two windows in a row agree
            log.info(
                "engine: %d torch threads (other processes took %.1f of %d CPUs)",
                target,
                self.others,
                self.usable,
            )
            self.threads, self._pending = target, None
            self.changes += 1
            self.apply(target)
        else:
            self._pending = target
