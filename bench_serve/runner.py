"""One run: send a workload's requests at their times, under the run's bounds, and collect records.

t=0 ─ send_times[i] ─► (turn - 1 of its conversation done) ─► (a concurrency slot) ─► send
                                                               │
max_s: nothing is sent after it ────────────────────────────────┘
max_s + drain_s: whatever still streams is cut off (error kind cut_off)
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Sequence

import httpx
from tqdm import tqdm

from pdserve.bench_serve.client import Endpoint, send
from pdserve.bench_serve.records import RequestRecord
from pdserve.bench_serve.workload import WorkItem


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    max_concurrency: int | None = None  # requests in flight at once; None: no cap
    max_s: float = math.inf  # no request is sent after this many seconds
    drain_s: float = 120.0  # requests still running this long after max_s are cut off

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if not (self.max_s > 0 and self.drain_s >= 0):
            raise ValueError(f"the run needs max_s > 0 and drain_s >= 0, got {self.max_s}, {self.drain_s}")


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    records: tuple[RequestRecord, ...]  # the requests that were sent, in workload order
    duration_s: float  # start -> the last request's end
    num_unsent: int  # requests of the workload not sent before max_s


def run(
    items: Sequence[WorkItem],
    send_times: Sequence[float],
    endpoint: Endpoint,
    limits: Limits,
    progress: bool = True,
) -> RunResult:
    """Runs ``items[:len(send_times)]``, item i at ``send_times[i]`` seconds."""
    return asyncio.run(_run(items[: len(send_times)], send_times, endpoint, limits, progress))


class _Run:
    """The shared state of one run's request tasks."""

    def __init__(self, items: Sequence[WorkItem], endpoint: Endpoint, limits: Limits, bar: tqdm) -> None:
        self.items, self.endpoint, self.limits, self.bar = items, endpoint, limits, bar
        self.start = time.perf_counter()
        self.stop_sending = self.start + limits.max_s
        self.deadline = None if math.isinf(limits.max_s) else self.stop_sending + limits.drain_s
        self.slots = asyncio.Semaphore(limits.max_concurrency or len(items) or 1)
        # (conversation, turn) -> set once that turn finished, ok or not
        self.turn_done = {
            (i.conversation, i.turn): asyncio.Event() for i in items if i.conversation is not None
        }
        self.last_end = self.start

    async def one(self, http: httpx.AsyncClient, index: int, send_at: float) -> RequestRecord | None:
        item = self.items[index]
        try:
            await asyncio.sleep(max(0.0, self.start + send_at - time.perf_counter()))
            previous = self.turn_done.get((item.conversation, item.turn - 1))
            if previous is not None:
                await previous.wait()
            async with self.slots:
                if time.perf_counter() >= self.stop_sending:
                    return None
                record = await send(http, self.endpoint, item, index, self.start, self.deadline)
                self.last_end = max(self.last_end, time.perf_counter())
                return record
        finally:
            if item.conversation is not None:
                self.turn_done[(item.conversation, item.turn)].set()
            self.bar.update(1)


async def _run(
    items: Sequence[WorkItem], send_times: Sequence[float], endpoint: Endpoint, limits: Limits, progress: bool
) -> RunResult:
    connections = httpx.Limits(max_connections=limits.max_concurrency, max_keepalive_connections=None)
    with tqdm(total=len(items), disable=not progress, unit="req", desc="requests", leave=False) as bar:
        state = _Run(items, endpoint, limits, bar)
        async with httpx.AsyncClient(limits=connections, timeout=endpoint.timeout_s) as http:
            results = await asyncio.gather(*(state.one(http, i, t) for i, t in enumerate(send_times)))
    records = tuple(r for r in results if r is not None)
    return RunResult(records, state.last_end - state.start, len(results) - len(records))
