"""The model corrected by what the cluster measures: a prefill-time scale per shape family.

A calibration profile is taken once, in a process of its own; a running cluster's prefills cost
more or less than it says (a prefill node also sends its KV, its neighbours compete for the
memory bus, requests pay the router's own work). The autoscaler sees the difference in every
window: the mean TTFT it measured on the shape it runs against the one the model gives that
shape for the window's load. The scale under which the two agree is found by bisection, and
each family keeps a running (geometric) mean of its fits:

    window on 1P+1D, mean TTFT 2.2 s   ─► the prefill scale s with simulate(profile x s) = 2.2 s
                                       ─► disaggregated scale <- scale^(1-w) * s^w
    every disaggregated shape is then ranked on the profile with its prefills x scale

The families: shapes with prefill nodes (their TTFT is the prefill pool's) and shapes of colocated
nodes only. The error depends on the load's mix as well (a colocated node's prefills wait on
decode steps only when outputs are long), so a fit holds for loads near the one it was measured
on: each fit keeps its window's mean prompt and output lengths, and a window's scale per family
is the running mean of that family's fits within a factor NEAR of its own lengths in both: a
scale fitted while outputs were long does not hold a shape back once they are short again.

A family with no fit near the load takes the scale of the family that has them, or 1 (the profile
as calibrated) when neither has. Only the family the cluster runs is ever measured, and what
makes it slower than its profile (the machine's state, its neighbours, the router's own work)
is as likely to hold for the other: giving the unmeasured family the profile's own speed would
make it look better for being unmeasured, and the pool would move to it whenever the shape it
runs measures slow (run 12 of the shifting-load study: 2 colocated measured x1.64 in its first
windows, 1P+1D was ranked at x1.00, and the pool moved to 1P+1D and stayed). The families are told
apart by their own fits once the pool has run both on a load like this one.
Torch-free.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

from pdserve.bench_serve.metrics import Slo
from pdserve.planner.profile import Profile
from pdserve.planner.simulate import Cluster, SimRequest, simulate

SCALE_MIN, SCALE_MAX = 0.5, 3.0  # a fit is kept within these
FIT_STEPS = 7  # bisection steps in log space: within 1.5% of the fit
WEIGHT = 0.25  # a window's share of the running mean (about eight windows to settle)
FAMILIES = ("disaggregated", "colocated")
NEAR = 1.5  # loads whose mean prompt and output lengths are both within this factor share fits
MEMORY = 64  # fits kept per family (at one a window: minutes of load)


def family(cluster: Cluster) -> str:
    return "disaggregated" if cluster.num_prefill else "colocated"


def mean_ttft_s(profile: Profile, cluster: Cluster, requests: Sequence[SimRequest], slo: Slo) -> float | None:
    """The model's mean TTFT over the requests it does not shed (None: it sheds them all)."""
    ttfts = [o.ttft_s for o in simulate(profile, cluster, requests, slo) if o.ttft_s is not None]
    return sum(ttfts) / len(ttfts) if ttfts else None


def fit_prefill_scale(
    profile: Profile, cluster: Cluster, requests: Sequence[SimRequest], slo: Slo, measured_ttft_s: float
) -> float:
    """The prefill scale (within SCALE_MIN..SCALE_MAX) under which the model's mean TTFT for
    ``requests`` on ``cluster`` is the measured one. The model's TTFT grows with the scale (until
    shedding caps it: a measured TTFT past the cap fits SCALE_MAX)."""
    lo, hi = math.log(SCALE_MIN), math.log(SCALE_MAX)
    for _ in range(FIT_STEPS):
        mid = (lo + hi) / 2
        modelled = mean_ttft_s(profile.with_prefill_scale(math.exp(mid)), cluster, requests, slo)
        if modelled is not None and modelled < measured_ttft_s:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """A window's mix: its mean prompt and output lengths in tokens."""

    prompt_tokens: float
    output_tokens: float

    def near(self, other: Load) -> bool:
        return all(
            abs(math.log(max(a, 1.0) / max(b, 1.0))) <= math.log(NEAR)
            for a, b in ((self.prompt_tokens, other.prompt_tokens), (self.output_tokens, other.output_tokens))
        )


class Corrections:
    """Each family's fits, with the load each was measured on; ``prefill_scale``: the families'
    scales at the load last focused on (``focus``), each a running geometric mean of its near fits."""

    def __init__(self) -> None:
        self._fits: dict[str, collections.deque[tuple[Load, float]]] = {
            name: collections.deque(maxlen=MEMORY) for name in FAMILIES
        }
        self.prefill_scale: dict[str, float] = dict.fromkeys(FAMILIES, 1.0)
        self.num_near: dict[str, int] = dict.fromkeys(FAMILIES, 0)  # the fits behind each scale

    def update(
        self,
        profile: Profile,
        cluster: Cluster,
        requests: Sequence[SimRequest],
        slo: Slo,
        measured_ttft_s: float,
        load: Load,
    ) -> float:
        """Keep a window's fit for the cluster's family, and focus on its load; returns the fit."""
        fit = fit_prefill_scale(profile, cluster, requests, slo, measured_ttft_s)
        self._fits[family(cluster)].append((load, fit))
        self.focus(load)
        return fit

    def focus(self, load: Load) -> None:
        """Set each family's scale to the running mean (from 1, oldest first) of its fits near
        ``load``; a family without one takes the scale of the family with them."""
        for name, fits in self._fits.items():
            log_scale, num = 0.0, 0
            for at, fit in fits:
                if at.near(load):
                    log_scale = (1 - WEIGHT) * log_scale + WEIGHT * math.log(fit)
                    num += 1
            self.prefill_scale[name], self.num_near[name] = math.exp(log_scale), num
        for name in FAMILIES:
            if (lender := self.lender(name)) is not None:
                self.prefill_scale[name] = self.prefill_scale[lender]

    def lender(self, name: str) -> str | None:
        """The family whose scale ``name`` took, having no fit of its own near the load (None: its own)."""
        if self.num_near[name]:
            return None
        return next((other for other in FAMILIES if self.num_near[other]), None)

    def profile_for(self, profile: Profile, cluster: Cluster) -> Profile:
        return profile.with_prefill_scale(self.prefill_scale[family(cluster)])

    def describe(self) -> str:
        return ", ".join(
            f"{name} x{scale:.2f} ({self.num_near[name]} fit(s) near this load"
            + (f"; {lender}'s" if (lender := self.lender(name)) else "")
            + ")"
            for name, scale in self.prefill_scale.items()
        )
