"""Per-role scaling decisions from measured load: the planner's model picks the cluster shape, and
hysteresis and a cooldown keep the choice from flapping.

    Observation (a window of the router's metrics): arrivals, shed requests, prompt and output lengths
      ─► demand: Poisson arrivals at the window's rate, lengths spread around its means (seeded)
      ─► the current shape's family's prefill scale refitted to the window's mean TTFT
         (planner.correction: the model's prefill times as this cluster measures them)
      ─► every shape within the node budget simulated on it (planner.recommend.rank) with its
         family's prefill scale, less what
         was measured: a shape the model said meets the SLOs and the router's window saw miss them
         counts at its measured share on loads at least as heavy, for MISS_MEMORY_S, where that
         means growing out of it or not shrinking back into it
      ─► the best shape, where it beats the current one by ``margin`` of requests within the SLOs,
         or meets the SLOs with fewer nodes while the measured window meets them too
      ─► the same target on ``confirm`` windows in a row (``shrink_confirm`` for fewer nodes), and
         none but growth within ``cooldown_s`` of a change
      ─► Decision(kind, current, target, reason)

The window's own SLO attainment (the router's TTFT and TPOT histograms) is reported beside the
prediction and keeps the pool from shrinking while requests miss their targets; the shape itself
is chosen by the model, as `pdserve plan recommend` chooses it, except where the window refuted it:
the model's figure for the shape the cluster runs can be checked, and where it said the SLOs are
met and they were not, the measured share stands in for it (on that load or a heavier one): the
pool grows out of a shape the model overrates, and does not shrink back into it while the load
stays. Between shapes of as many nodes the model alone decides.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import enum
import random

from pdserve.bench_serve.metrics import Slo
from pdserve.planner.correction import Corrections, Load, family
from pdserve.planner.profile import Profile
from pdserve.planner.recommend import Candidate, order, rank, shapes
from pdserve.planner.simulate import Cluster, SimRequest
from pdserve.router.config import LOCAL_PREFILL_MARGIN_S  # a plain dataclass module: no torch

HORIZON_S = 60.0  # the demand is simulated over this long ...
MIN_SIM_REQUESTS, MAX_SIM_REQUESTS = 24, 240  # ... in this many requests
LENGTH_SPREAD = 0.5  # lengths drawn uniformly within +-50% of the window's means
MISS_MEMORY_S = 600.0  # how long a shape measured missing the SLOs counts at its measured share
MISS_LOAD_SHARE = 0.9  # ... on a load of at least this share of the one it missed on (tokens/s in and out)


class Kind(enum.StrEnum):
    """What a decision did, and why in one word (a label on /metrics)."""

    SCALE = "scale"  # change to the target shape
    IDLE = "idle"  # too few requests in the window to judge
    COOLDOWN = "cooldown"  # a change happened too recently
    CONFIRMING = "confirming"  # a better shape, not yet seen on enough windows in a row
    BEST = "best"  # the current shape is the best the model knows for this load
    NO_GAIN = "no_gain"  # a better shape, but not by the margin
    MISSING_SLO = "missing_slo"  # fewer nodes would do by the model, but the window missed the SLOs


@dataclasses.dataclass(frozen=True, slots=True)
class Observation:
    """One window of the router's metrics (differences of two scrapes)."""

    window_s: float  # seconds between the scrapes
    num_finished: int  # samples that got a first token (TTFT observations)
    num_shed: int  # requests refused with 429 (demand the cluster did not take)
    mean_prompt_tokens: float  # of the finished samples
    mean_output_tokens: float
    ttft_met: float | None  # share of TTFT observations within the SLO (None: none in the window)
    tpot_met: float | None
    prefill_backlog_s: float  # summed over the prefill nodes, at the second scrape
    decode_kv_use: float  # the fullest decode or colocated node's KV pool, 0..1
    mean_ttft_s: float | None = None  # of the TTFT observations (None: none in the window)

    @property
    def num_arrived(self) -> int:
        return self.num_finished + self.num_shed

    @property
    def rate(self) -> float:
        return self.num_arrived / self.window_s if self.window_s > 0 else 0.0

    @property
    def slo_met(self) -> float | None:
        """The smaller of the two shares; shed requests count as missed."""
        shares = [s for s in (self.ttft_met, self.tpot_met) if s is not None]
        if not shares or not self.num_arrived:
            return None
        return min(shares) * self.num_finished / self.num_arrived

    def describe(self) -> str:
        met = "-" if self.slo_met is None else f"{self.slo_met:.0%}"
        return (
            f"{self.rate:.2f} req/s ({self.num_shed} shed), prompts ~{self.mean_prompt_tokens:.0f} "
            f"tokens, outputs ~{self.mean_output_tokens:.0f}; SLO met {met}; prefill backlog "
            f"{self.prefill_backlog_s:.1f} s; decode KV {self.decode_kv_use:.0%}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    kind: Kind
    current: Cluster
    target: Cluster  # == current unless kind is SCALE
    reason: str
    predicted: dict[str, float]  # shape label -> predicted share of requests within the SLOs
    prefill_scale: dict[str, float] = dataclasses.field(default_factory=dict)  # planner.correction's

    def to_json(self) -> dict:
        return {
            "kind": str(self.kind),
            "current": self.current.label,
            "target": self.target.label,
            "target_nodes": shape_counts(self.target),
            "reason": self.reason,
            "predicted_slo_fraction": {k: round(v, 3) for k, v in self.predicted.items()},
            "prefill_scale": {k: round(v, 3) for k, v in self.prefill_scale.items()},
        }


def shape_counts(cluster: Cluster) -> dict[str, int]:
    return {
        "prefill": cluster.num_prefill,
        "decode": cluster.num_decode,
        "colocated": cluster.num_colocated,
    }


def demand(obs: Observation, seed: int = 0) -> list[SimRequest]:
    """The window's load as simulated requests: Poisson arrivals at its rate over HORIZON_S."""
    rng = random.Random(seed)
    num = max(MIN_SIM_REQUESTS, min(MAX_SIM_REQUESTS, round(obs.rate * HORIZON_S)))
    out, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(obs.rate)
        out.append(SimRequest(t, _spread(rng, obs.mean_prompt_tokens), _spread(rng, obs.mean_output_tokens)))
    return out


def _spread(rng: random.Random, mean: float) -> int:
    return max(1, round(mean * rng.uniform(1 - LENGTH_SPREAD, 1 + LENGTH_SPREAD)))


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingSettings:
    slo: Slo
    max_nodes: int  # the node budget (the machine's cores and memory at one node per share)
    min_nodes: int = 1  # never fewer (a node started later takes its model load's time)
    min_fraction: float = 0.9  # a shape "meets" the SLOs when this share of requests does
    margin: float = 0.05  # a change must win this share of requests over the current shape
    confirm: int = 2  # windows in a row that must name the same target
    # ... and for a target of fewer nodes: a load's lull must last before a node goes (it takes a
    # start to get back), while a shortage is acted on at once
    shrink_confirm: int = 6
    cooldown_s: float = 30.0  # no change within this long of the last one, but growth
    min_requests: int = 8  # a window with fewer arrivals is not judged
    disagg_threshold: int = 64  # as the router's
    local_prefill_margin_s: float = LOCAL_PREFILL_MARGIN_S  # as the router's
    colocated: bool = True  # colocated shapes are candidates
    correct_prefill: bool = True  # rank on the measured prefill scales (else: measured, reported only)

    def __post_init__(self) -> None:
        if (
            not 1 <= self.min_nodes <= self.max_nodes
            or min(self.confirm, self.shrink_confirm, self.min_requests) < 1
        ):
            raise ValueError(
                "need 1 <= min_nodes <= max_nodes, and confirm, shrink_confirm and min_requests >= 1"
            )
        if not 0 < self.min_fraction <= 1 or not 0 <= self.margin < 1 or self.cooldown_s < 0:
            raise ValueError("min_fraction in (0, 1], margin in [0, 1), cooldown_s >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class Miss:
    """A shape the model said meets the SLOs, measured missing them on a load."""

    prompt_tokens_per_s: float
    output_tokens_per_s: float
    measured: float  # the window's share within the SLOs
    at_s: float

    def applies(self, obs: Observation, now_s: float) -> bool:
        """Whether ``obs`` is a load at least as heavy, recently enough."""
        return (
            now_s - self.at_s <= MISS_MEMORY_S
            and obs.rate * obs.mean_prompt_tokens >= MISS_LOAD_SHARE * self.prompt_tokens_per_s
            and obs.rate * obs.mean_output_tokens >= MISS_LOAD_SHARE * self.output_tokens_per_s
        )


class ScalingPolicy:
    """Decides one window at a time; remembers the pending target, the last change, and the
    shapes measured missing the SLOs where the model said they meet them."""

    def __init__(self, profile: Profile, settings: ScalingSettings) -> None:
        self.profile = profile
        self.settings = settings
        self._pending: tuple[str, int] | None = None  # (target label, windows in a row)
        self._last_change_s: float | None = None
        self.misses: dict[str, Miss] = {}  # shape label -> its latest refuted prediction
        self.corrections = Corrections()  # the model's prefill times as the windows measure them

    def decide(self, obs: Observation, current: Cluster, now_s: float) -> Decision:
        s = self.settings
        if obs.num_arrived < s.min_requests or obs.rate <= 0:
            self._pending = None
            return self._decision(
                Kind.IDLE, current, current, f"{obs.num_arrived} request(s) in the window", {}
            )
        requests = demand(obs)
        load = Load(obs.mean_prompt_tokens, obs.mean_output_tokens)
        if obs.mean_ttft_s is not None and obs.num_finished >= s.min_requests and not self._settling(now_s):
            self.corrections.update(self.profile, current, requests, s.slo, obs.mean_ttft_s, load)
        else:
            self.corrections.focus(load)
        modelled = self._rank(requests, current)
        predicted = {c.cluster.label: c.slo_fraction for c in modelled}  # the model's, as reported
        self._check(obs, current, predicted[current.label], now_s)
        measured = {label: m.measured for label, m in self.misses.items() if m.applies(obs, now_s)}
        ranked = self._measured(modelled, measured, current)
        kind, target, why = self._choose(
            ranked, current, {c.cluster.label: c.slo_fraction for c in ranked}, obs
        )
        reason = f"{why}; observed {obs.describe()}"
        refuted = [f"{label} {share:.0%}" for label, share in measured.items() if label in predicted]
        if refuted:
            reason += f"; measured, not modelled, on as heavy a load: {', '.join(refuted)}"
        reason += f"; prefill times as measured: {self.corrections.describe()}"
        if kind is not Kind.SCALE:
            self._pending = None
            return self._decision(kind, current, current, reason, predicted)
        return self._gate(target, current, reason, predicted, now_s)

    def _decision(
        self, kind: Kind, current: Cluster, target: Cluster, reason: str, predicted: dict[str, float]
    ) -> Decision:
        scale = dict(self.corrections.prefill_scale)
        return Decision(kind, current, target, reason, predicted, scale)

    def _rank(self, requests: list[SimRequest], current: Cluster) -> list[Candidate]:
        """Every candidate simulated on the profile its family's measured prefill scale corrects."""
        s = self.settings
        by_family: dict[str, list[Cluster]] = {}
        for cluster in self._candidates(current):
            by_family.setdefault(family(cluster), []).append(cluster)
        found = [
            candidate
            for clusters in by_family.values()
            for candidate in rank(
                self.corrections.profile_for(self.profile, clusters[0])
                if s.correct_prefill
                else self.profile,
                requests,
                s.slo,
                clusters,
                s.min_fraction,
            )
        ]
        return order(found, s.min_fraction)

    def _settling(self, now_s: float) -> bool:
        """Within the cooldown of a change: the shape before it still finishes its requests."""
        last = self._last_change_s
        return last is not None and now_s - last < self.settings.cooldown_s

    def _measured(
        self, modelled: list[Candidate], measured: dict[str, float], current: Cluster
    ) -> list[Candidate]:
        """The candidates as the measured shares (of misses that apply to this load) correct them: a shape of fewer nodes than
        the current one, measured missing the SLOs on as heavy a load, counts at its measured
        share (no shrinking back into it); and so does the current shape where it can grow, but
        then only the shapes of more nodes may replace it. Shapes of as many nodes are compared by
        the model alone: against the current shape's measured share every unmeasured one would
        look better, and the pool would go round them under a load none of them meets."""
        s = self.settings
        grow = current.label in measured and current.num_nodes < s.max_nodes
        out = []
        for c in modelled:
            mine, nodes = c.cluster.label == current.label, c.cluster.num_nodes
            if grow and not mine and nodes <= current.num_nodes:
                continue
            if c.cluster.label in measured and (nodes < current.num_nodes or (mine and grow)):
                c = dataclasses.replace(c, slo_fraction=min(c.slo_fraction, measured[c.cluster.label]))
            out.append(c)
        return order(out, s.min_fraction)

    def _check(self, obs: Observation, current: Cluster, predicted: float, now_s: float) -> None:
        """Hold the model to what the window measured on the shape it ran (after the cooldown of a
        change: the requests of the shape before it finish in the first windows after)."""
        measured, s = obs.slo_met, self.settings
        if measured is None or self._settling(now_s):
            return
        if measured < s.min_fraction <= predicted:
            load = (obs.rate * obs.mean_prompt_tokens, obs.rate * obs.mean_output_tokens)
            self.misses[current.label] = Miss(*load, measured, now_s)
        elif (
            measured >= s.min_fraction
            and (miss := self.misses.get(current.label))
            and miss.applies(obs, now_s)
        ):
            del self.misses[current.label]  # it met them on as heavy a load: the miss was passing

    def _candidates(self, current: Cluster) -> list[Cluster]:
        s = self.settings
        found = [
            c
            for c in shapes(s.max_nodes, s.disagg_threshold, s.colocated, s.local_prefill_margin_s)
            if c.num_nodes >= s.min_nodes
        ]
        if not any(c.label == current.label for c in found):
            found.append(current)  # a shape outside the search (P+D+C) is still compared
        return found

    def _choose(
        self, ranked: list[Candidate], current: Cluster, predicted: dict[str, float], obs: Observation
    ) -> tuple[Kind, Cluster, str]:
        s = self.settings
        now = predicted[current.label]
        measured = obs.slo_met
        if (
            measured is not None
            and measured < s.min_fraction
            and ranked[0].cluster.num_nodes < current.num_nodes
        ):
            # never fewer nodes while the window misses the SLOs: the best shape of as many or more
            more = [c for c in ranked if c.cluster.num_nodes >= current.num_nodes]
            if more[0].cluster.label == current.label or more[0].slo_fraction - now < s.margin:
                return (
                    Kind.MISSING_SLO,
                    current,
                    f"{ranked[0].cluster.label} would do with fewer nodes, but the window met the "
                    f"SLOs for {measured:.0%} only",
                )
            ranked = more
        best = ranked[0]
        gain = best.slo_fraction - now
        mine = next(c for c in ranked if c.cluster.label == current.label)
        tied = mine.meets(s.min_fraction) == best.meets(s.min_fraction) and gain <= 0
        if tied and (mine.cluster.num_nodes == best.cluster.num_nodes or not best.meets(s.min_fraction)):
            return Kind.BEST, current, f"{current.label} is the best shape (predicted {now:.0%} within SLO)"
        fewer = best.cluster.num_nodes < current.num_nodes and best.meets(s.min_fraction)
        if fewer and gain < s.margin:
            return (
                Kind.SCALE,
                best.cluster,
                f"{best.cluster.label} meets the SLOs with fewer nodes (predicted "
                f"{best.slo_fraction:.0%}, {current.label} {now:.0%})",
            )
        if gain < s.margin:
            return (
                Kind.NO_GAIN,
                current,
                f"{best.cluster.label} predicted {best.slo_fraction:.0%} against {current.label}'s "
                f"{now:.0%}: under the {s.margin:.0%} margin",
            )
        return (
            Kind.SCALE,
            best.cluster,
            f"{best.cluster.label} predicted {best.slo_fraction:.0%} within SLO, {current.label} {now:.0%}",
        )

    def _gate(
        self, target: Cluster, current: Cluster, reason: str, predicted: dict[str, float], now_s: float
    ) -> Decision:
        """Hysteresis (the same target on ``confirm`` windows, ``shrink_confirm`` for fewer nodes)
        and the cooldown, which holds every change but growth."""
        s = self.settings
        label, seen = self._pending or ("", 0)
        seen = seen + 1 if label == target.label else 1
        self._pending = (target.label, seen)
        grows = target.num_nodes > current.num_nodes
        if not grows and self._last_change_s is not None and now_s - self._last_change_s < s.cooldown_s:
            left = s.cooldown_s - (now_s - self._last_change_s)
            return self._decision(
                Kind.COOLDOWN, current, current, f"{left:.0f} s of cooldown left; {reason}", predicted
            )
        needed = s.shrink_confirm if target.num_nodes < current.num_nodes else s.confirm
        if seen < needed:
            return self._decision(
                Kind.CONFIRMING, current, current, f"window {seen} of {needed}; {reason}", predicted
            )
        self._pending = None
        self._last_change_s = now_s
        return self._decision(Kind.SCALE, current, target, reason, predicted)

    def changed(self, now_s: float) -> None:
        """A change happened outside the policy (an operator's role switch): the cooldown starts."""
        self._last_change_s = now_s
        self._pending = None
