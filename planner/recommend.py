"""Search cluster shapes for the smallest one that meets the SLOs at a target rate (by simulation)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.bench_serve.metrics import Slo, Summary
from pdserve.planner.predict import predict, slo_fraction
from pdserve.planner.profile import Profile
from pdserve.planner.simulate import Cluster, SimRequest
from pdserve.router.config import LOCAL_PREFILL_MARGIN_S


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    cluster: Cluster
    summary: Summary
    slo_fraction: float  # share of requests that met both targets

    def meets(self, min_fraction: float) -> bool:
        return self.slo_fraction >= min_fraction


def shapes(
    max_nodes: int,
    disagg_threshold: int = 64,
    colocated: bool = True,
    local_prefill_margin_s: float = LOCAL_PREFILL_MARGIN_S,
) -> list[Cluster]:
    """Every P+D split with one or more of each, and (optionally) every colocated count, up to max_nodes."""
    found = [
        Cluster(p, d, 0, disagg_threshold, local_prefill_margin_s=local_prefill_margin_s)
        for total in range(2, max_nodes + 1)
        for p in range(1, total)
        for d in (total - p,)
    ]
    if colocated:
        found += [Cluster(0, 0, c, disagg_threshold) for c in range(1, max_nodes + 1)]
    return found


def rank(
    profile: Profile,
    requests: Sequence[SimRequest],
    slo: Slo,
    clusters: Sequence[Cluster],
    min_fraction: float,
    slo_flags: bool = True,
) -> list[Candidate]:
    """All candidates, best first: those meeting the SLOs (fewest nodes, then highest share),
    then the others (highest share first). ``slo_flags``: as ``predict``'s."""
    candidates = []
    for cluster in clusters:
        summary = predict(profile, cluster, requests, slo, slo_flags)
        candidates.append(Candidate(cluster, summary, slo_fraction(summary)))
    return order(candidates, min_fraction)


def order(candidates: Sequence[Candidate], min_fraction: float) -> list[Candidate]:
    """Best first: those meeting the SLOs (fewest nodes, then highest share), then the others
    (highest share first)."""

    def key(c: Candidate) -> tuple[bool, int, float, str]:
        meets = c.meets(min_fraction)
        return (not meets, c.cluster.num_nodes if meets else 0, -c.slo_fraction, c.cluster.label)

    return sorted(candidates, key=key)
