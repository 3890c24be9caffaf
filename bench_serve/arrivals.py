"""When each request is sent: seeded gaps at a mean rate, or all at once under a concurrency cap.

The gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``: burstiness 1 is
a Poisson process, below 1 requests come in bursts, above 1 they come more evenly. The first
request goes at 0 s. An infinite rate sends everything at once, which with a concurrency cap in
the runner is a closed loop at fixed concurrency.
"""

from __future__ import annotations

import dataclasses
import math
import random


@dataclasses.dataclass(frozen=True, slots=True)
class Arrivals:
    rate: float  # mean requests per second; math.inf: all at 0 s
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0: Poisson
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"request rate must be > 0, got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")

    def send_times(self, num: int, max_s: float = math.inf) -> list[float]:
        """Send times of at most ``num`` requests, the ones before ``max_s`` seconds."""
        if math.isinf(self.rate):
            return [0.0] * num if max_s > 0 else []
        rng = random.Random(self.seed)
        scale = 1.0 / (self.rate * self.burstiness)
        times: list[float] = []
        t = 0.0
        while len(times) < num and t < max_s:
            times.append(t)
            t += rng.gammavariate(self.burstiness, scale)
        return times


def replayed_times(arrivals: list[float], num: int, max_s: float = math.inf) -> list[float]:
    """A trace's own send times, bounded the same way."""
    return [t for t in arrivals[:num] if t < max_s]
