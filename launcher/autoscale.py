"""`pdserve up --autoscale`: a controller in the launcher that resizes the prefill, decode and
colocated pools from the router's metrics.

    every interval:  GET /metrics ─► Observation (the window since the last scrape)
                       ─► ScalingPolicy.decide (planner/scaling.py: the planner's model, hysteresis,
                          cooldown) ─► logged (autoscale.log, one JSON line) and reported to the
                          router (POST /admin/autoscale: /metrics shows it)
                       ─► a SCALE decision is acted on: role switches first (POST /admin/nodes/{id}/role:
                          the node drains its old role's work and keeps its weights), then surplus
                          nodes stop by draining (SIGTERM), then missing ones start

Within the node budget (``--max-nodes``, by default the nodes `pdserve up` started with: the
machine's cores at the planned threads per node). Torch-free: the launcher loads no model.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench_serve.metrics import Slo
from pdserve.planner.scaling import Decision, Kind, Observation, ScalingPolicy
from pdserve.planner.simulate import Cluster

Samples = dict[str, list[tuple[dict[str, str], float]]]  # metric sample name -> (labels, value)
HTTP_TIMEOUT_S = 5.0
SWITCH_TIMEOUT_S = 90.0  # a role switch drains the node's old role first
LOOKBACK_INTERVALS = 12  # a window reaches this many scrapes back to hold min_requests arrivals


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _total(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, ()) if all(lab.get(k) == x for k, x in labels.items()))


def _met(before: Samples, after: Samples, name: str, target_s: float) -> float | None:
    """Share of a histogram's observations in the window at or under ``target_s``, interpolated
    linearly within the bucket the target falls in (as histogram_quantile reads buckets); past the
    last finite bound, the count at that bound."""
    count = _total(after, name + "_count") - _total(before, name + "_count")
    if count <= 0:
        return None
    cumulative = sorted(
        (float(lab["le"]), v - _total(before, name + "_bucket", le=lab["le"]))
        for lab, v in after.get(name + "_bucket", ())
        if lab.get("le") != "+Inf"
    )
    lo_bound, lo_count = 0.0, 0.0
    for bound, within in cumulative:
        if target_s <= bound:
            within = lo_count + (within - lo_count) * (target_s - lo_bound) / (bound - lo_bound)
            return max(0.0, min(1.0, within / count))
        lo_bound, lo_count = bound, within
    return max(0.0, min(1.0, lo_count / count))


def observe(before: Samples, after: Samples, window_s: float, slo: Slo) -> Observation:
    """The window between two scrapes as the policy reads it."""

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, **labels) - _total(before, name, **labels)

    finished = delta("pdserve_e2e_request_latency_seconds_count")
    first_tokens = delta("pdserve_time_to_first_token_seconds_count")
    kv_use = [
        used / total
        for (lab, used) in after.get("pdserve_node_kv_blocks_used", ())
        if lab.get("role") in ("decode", "colocated")
        for total in [_total(after, "pdserve_node_kv_blocks_total", node_id=lab["node_id"])]
        if total > 0
    ]
    return Observation(
        window_s=window_s,
        num_finished=int(first_tokens),
        num_shed=int(delta("pdserve_shed_total")),
        mean_prompt_tokens=delta("pdserve_prompt_tokens_total") / finished if finished else 0.0,
        mean_output_tokens=delta("pdserve_generation_tokens_total") / finished if finished else 0.0,
        ttft_met=_met(before, after, "pdserve_time_to_first_token_seconds", slo.ttft_s),
        tpot_met=_met(before, after, "pdserve_time_per_output_token_seconds", slo.tpot_s),
        prefill_backlog_s=_total(after, "pdserve_node_prefill_backlog_seconds"),
        decode_kv_use=max(kv_use, default=0.0),
        mean_ttft_s=delta("pdserve_time_to_first_token_seconds_sum") / first_tokens if first_tokens else None,
    )


# --------------------------------------------------------------------------- moves


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    action: str  # "switch" | "stop" | "start"
    role: str  # the role a switched or started node takes; a stopped node's own
    node: str | None = None  # the launcher's child name (None: a node to start)


DECODING = ("decode", "colocated")  # roles that take requests; a switch between them needs no drain


def moves(roles: Mapping[str, str], target: Cluster) -> list[Move]:
    """From the nodes' roles (child name -> role) to the target's counts: switches first (a node
    keeps its weights), then stops (newest nodes first), then starts.

    Surplus decode and colocated nodes take the missing decode and colocated roles first: such a
    switch is instant, and it keeps a node that takes requests through the moves. A node that
    switches to or from prefill drains first, so it goes after them (1 colocated -> 1P+1D: the
    node becomes the decode node at once and a prefill node starts; the other way round it
    would drain the only node that decodes, and requests would find none)."""
    want = {"prefill": target.num_prefill, "decode": target.num_decode, "colocated": target.num_colocated}
    by_role: dict[str, list[str]] = {r: [] for r in want}
    for name, role in roles.items():
        by_role[role].append(name)
    surplus = [n for r in want for n in sorted(by_role[r])[want[r] :]]  # the newest of each role
    short = [r for r in want for _ in range(max(0, want[r] - len(by_role[r])))]
    switches = []
    for node in [n for n in surplus if roles[n] in DECODING]:
        role = next((r for r in short if r in DECODING), None)
        if role is not None:
            switches.append(Move("switch", role, node))
            surplus.remove(node)
            short.remove(role)
    switches += [Move("switch", role, node) for node, role in zip(surplus, short, strict=False)]
    out = switches + [Move("stop", roles[node], node) for node in surplus[len(short) :]]
    return out + [Move("start", role) for role in short[len(surplus) :]]


# --------------------------------------------------------------------------- the controller


class Autoscaler:
    """Ticked from the launcher's watch loop (one thread acts on the cluster)."""

    def __init__(
        self,
        cluster,  # launcher.cluster.LocalCluster
        policy: ScalingPolicy,
        interval_s: float,
        api_key: str | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.interval_s = interval_s
        self.api_key = api_key
        self.say = say
        self.log_path: pathlib.Path = cluster.plan.log_dir / "autoscale.log"
        self._scrapes: collections.deque[tuple[float, Samples]] = collections.deque()  # (monotonic s, scrape)

    def tick(self) -> None:
        """A decision when an interval has passed since the last scrape."""
        now = time.monotonic()
        if self._scrapes and now - self._scrapes[-1][0] < self.interval_s:
            return
        try:
            samples = parse_metrics(self._get("/metrics").decode())
        except (OSError, ValueError) as exc:
            self._log({"event": "scrape_failed", "error": str(exc)})
            return
        window = self._window(now, samples)
        self._scrapes.append((now, samples))
        if window is None:
            return
        decision = self.policy.decide(window, self.shape(), now)
        self._record(decision)
        if decision.kind is Kind.SCALE:
            self._act(decision)
            self._scrapes.clear()  # the next window starts on the new shape
            self._scrapes.append((time.monotonic(), parse_metrics(self._get("/metrics").decode())))

    def _window(self, now: float, samples: Samples) -> Observation | None:
        """Since the newest earlier scrape that leaves ``min_requests`` arrivals in the window, or
        the oldest one kept (LOOKBACK_INTERVALS back): a slow load is judged on a longer window."""
        while len(self._scrapes) > LOOKBACK_INTERVALS:
            self._scrapes.popleft()
        obs = None
        for then, before in reversed(self._scrapes):
            obs = observe(before, samples, now - then, self.policy.settings.slo)
            if obs.num_arrived >= self.policy.settings.min_requests:
                break
        return obs

    def shape(self) -> Cluster:
        roles = self.cluster.node_roles().values()
        return dataclasses.replace(
            self.policy_template,
            num_prefill=sum(r == "prefill" for r in roles),
            num_decode=sum(r == "decode" for r in roles),
            num_colocated=sum(r == "colocated" for r in roles),
        )

    @property
    def policy_template(self) -> Cluster:
        s = self.policy.settings
        return Cluster(0, 0, 1, s.disagg_threshold, local_prefill_margin_s=s.local_prefill_margin_s)

    def _record(self, decision: Decision) -> None:
        body = decision.to_json()
        self._log({"event": "decision", **body})
        if decision.kind is Kind.SCALE:
            self.say(f"autoscale: {decision.current.label} -> {decision.target.label}: {decision.reason}")
        try:
            self._post("/admin/autoscale", body)
        except (OSError, ValueError) as exc:
            self._log({"event": "report_failed", "error": str(exc)})

    def _act(self, decision: Decision) -> None:
        for move in moves(self.cluster.node_roles(), decision.target):
            started = time.monotonic()
            try:
                if move.action == "switch":
                    self._post(
                        f"/admin/nodes/{self.cluster.node_id(move.node)}/role",
                        {"role": move.role, "timeout_s": SWITCH_TIMEOUT_S},
                        timeout_s=SWITCH_TIMEOUT_S + 10,
                    )
                elif move.action == "stop":
                    self.cluster.stop_node(move.node)
                else:
                    name = self.cluster.add_node(move.role)
                    self._until_listed(self.cluster.node_id(name), self.cluster.plan.start_timeout_s)
                    move = dataclasses.replace(move, node=name)
            except Exception as exc:  # noqa: BLE001 - one failed move is logged; the next tick re-plans
                self._log({"event": "move_failed", **dataclasses.asdict(move), "error": str(exc)})
                self.say(f"autoscale: {move.action} {move.node or move.role} failed: {exc}")
                return
            seconds = round(time.monotonic() - started, 2)
            self._log({"event": "moved", **dataclasses.asdict(move), "seconds": seconds})
            self.say(
                f"autoscale: {move.action} {move.node or ''} -> {move.role} ({seconds} s)".replace("  ", " ")
            )

    def _until_listed(self, node_id: str, timeout_s: float) -> None:
        """Until the router routes to a node just started (the registry's next poll lists it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = json.loads(self._get("/admin/nodes"))["nodes"]
            if any(n["node_id"] == node_id and not n["draining"] for n in listed):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the router did not list node {node_id} within {timeout_s:.0f} s")

    def _log(self, record: dict) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")

    def _request(self, path: str, body: dict | None, timeout_s: float) -> bytes:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.cluster.plan.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            raise ValueError(
                f"{path}: HTTP {exc.code}: {exc.read()[:500].decode(errors='replace')}"
            ) from None

    def _get(self, path: str) -> bytes:
        return self._request(path, None, HTTP_TIMEOUT_S)

    def _post(self, path: str, body: dict, timeout_s: float = HTTP_TIMEOUT_S) -> bytes:
        return self._request(path, body, timeout_s)


# --------------------------------------------------------------------------- set-up


@dataclasses.dataclass(frozen=True, slots=True)
class AutoscaleOptions:
    """What `pdserve up --autoscale` was asked for."""

    slo: Slo
    profile: pathlib.Path | None  # None: calibrate the engine at launch
    max_nodes: int | None  # None: the nodes the cluster starts with
    min_nodes: int = 1
    interval_s: float = 5.0
    cooldown_s: float = 30.0
    min_slo_fraction: float = 0.9
    correct_prefill: bool = True  # rank on planner.correction's scales (off: --autoscale-trust-profile)


def router_settings(router_args: tuple[str, ...]) -> dict:
    """The router flags the autoscaler must agree with, read from ``--router-args`` (else the
    router's defaults)."""
    import argparse

    from pdserve.protocol.settings import flags
    from pdserve.router.config import RouterConfig

    parser = argparse.ArgumentParser(add_help=False)
    names = ("api_key", "disagg_threshold", "local_prefill_margin_s")
    for flag in flags(RouterConfig, only=names):
        flag.add_to(parser)
    known, _ = parser.parse_known_args(list(router_args))
    return {name: getattr(known, name) for name in names}


def calibrate(plan, out: pathlib.Path, say: Callable[[str], None]) -> pathlib.Path:
    """`pdserve plan calibrate` for this cluster's model and threads, in a child process, before
    the nodes start (they would slow it down)."""
    from pdserve.launcher.children import Child, stop_all
    from pdserve.launcher.cluster import LaunchError, child_env
    from pdserve.launcher.commands import pdserve_argv
    from pdserve.launcher.plan import usable_cores

    neighbours = max(0, min(plan.num_nodes, usable_cores() // plan.threads_per_node) - 1)
    argv = pdserve_argv(
        "plan", "calibrate", "--model", plan.model, "--threads", str(plan.threads_per_node),
        "--busy-neighbours", str(neighbours), "--out", str(out),
    )  # fmt: skip
    say(f"autoscale: calibrating the engine for the planner ({out}; --autoscale-profile FILE skips it)")
    child = Child("calibrate", argv, plan.log_dir / "calibrate.log", child_env(plan.threads_per_node))
    deadline = time.monotonic() + max(600.0, plan.start_timeout_s)
    while child.exit_code() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    code = child.exit_code()
    stop_all([child], 5)
    if code != 0:
        raise LaunchError(f"calibration failed (exit {code}):\n{child.log_tail()}")
    return out


def make_autoscaler(cluster, options: AutoscaleOptions, profile_path: pathlib.Path, say) -> Autoscaler:
    from pdserve.planner.profile import Profile
    from pdserve.planner.scaling import ScalingSettings

    plan = cluster.plan
    router = router_settings(plan.router_args)
    profile = Profile.load(profile_path)
    if profile.threads != plan.threads_per_node:
        say(
            f"autoscale: note: the profile was measured with {profile.threads} thread(s), "
            f"the nodes run {plan.threads_per_node}"
        )
    settings = ScalingSettings(
        slo=options.slo,
        max_nodes=options.max_nodes or plan.num_nodes,
        min_nodes=options.min_nodes,
        min_fraction=options.min_slo_fraction,
        cooldown_s=options.cooldown_s,
        correct_prefill=options.correct_prefill,
        disagg_threshold=router["disagg_threshold"],
        local_prefill_margin_s=router["local_prefill_margin_s"],
    )
    return Autoscaler(cluster, ScalingPolicy(profile, settings), options.interval_s, router["api_key"], say)
