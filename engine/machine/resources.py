"""What this machine gives the engine: the CPUs it may run on and the memory it may take.

Linux first (sched affinity, /proc/meminfo, cgroup v2 and v1 limits, so a container's quota
counts rather than the host's size); elsewhere the portable fallbacks. Torch-free.
"""

from __future__ import annotations

import math
import os
import pathlib

_CGROUP = pathlib.Path("/sys/fs/cgroup")


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time the cgroup allows (cpu.max or cfs_quota_us / cfs_period_us), if limited."""
    v2 = _read(_CGROUP / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100_000)
    cfs_quota, cfs_period = (
        _read(_CGROUP / "cpu" / "cpu.cfs_quota_us"),
        _read(_CGROUP / "cpu" / "cpu.cfs_period_us"),
    )
    if cfs_quota is None or cfs_period is None or int(cfs_quota) <= 0:
        return None
    return int(cfs_quota) / int(cfs_period)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup quota (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def _cgroup_memory_room() -> int | None:
    """Bytes left under the cgroup's memory limit (v2 memory.max, v1 limit_in_bytes), if limited."""
    for limit_file, usage_file in (
        (_CGROUP / "memory.max", _CGROUP / "memory.current"),
        (_CGROUP / "memory" / "memory.limit_in_bytes", _CGROUP / "memory" / "memory.usage_in_bytes"),
    ):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit is None or usage is None:
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 says "unlimited" with a huge number
            return None
        return max(0, int(limit) - int(usage))
    return None


def available_memory_bytes() -> int | None:
    """Memory a new allocation can take without swapping: MemAvailable, capped by the cgroup's room."""
    available = None
    meminfo = _read(pathlib.Path("/proc/meminfo"))
    if meminfo is not None:
        for line in meminfo.splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    room = _cgroup_memory_room()
    if room is not None:
        available = room if available is None else min(available, room)
    return available
