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
nodes only. A family the cluster has not run keeps scale 1 (the profile as measured).
Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench_serve.metrics import Slo
from planner.profile import Profile
from planner.simulate import Cluster, SimRequest, simulate

SCALE_MIN, SCALE_MAX = 0.5, 3.0  # a fit is kept within these
FIT_STEPS = 7  # bisection steps in log space: within 1.5% of the fit
WEIGHT = 0.25  # a window's share of the running mean (about eight windows to settle)
FAMILIES = ("disaggregated", "colocated")


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


class Corrections:
    """The families' prefill scales, each a running geometric mean of its windows' fits."""

    def __init__(self) -> None:
        self.prefill_scale: dict[str, float] = dict.fromkeys(FAMILIES, 1.0)

    def update(
        self,
        profile: Profile,
        cluster: Cluster,
        requests: Sequence[SimRequest],
        slo: Slo,
        measured_ttft_s: float,
    ) -> float:
        """Fold a window's fit into the cluster's family; returns the fit."""
        fit = fit_prefill_scale(profile, cluster, requests, slo, measured_ttft_s)
        key = family(cluster)
        self.prefill_scale[key] = math.exp(
            (1 - WEIGHT) * math.log(self.prefill_scale[key]) + WEIGHT * math.log(fit)
        )
        return fit

    def profile_for(self, profile: Profile, cluster: Cluster) -> Profile:
        return profile.with_prefill_scale(self.prefill_scale[family(cluster)])

    def describe(self) -> str:
        return ", ".join(f"{k} x{v:.2f}" for k, v in self.prefill_scale.items())
