"""The router's Prometheus metrics, written by prometheus-client on a registry of the router's own.

Counters and histograms are updated as requests go; the gauges of node load and each node's
engine-step series are read from the live state at scrape time (``LiveStateCollector``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pdserve.protocol.registry import STEP_BUCKETS_S as BUCKETS_S
from pdserve.protocol.registry import NodeInfo, Role
from pdserve.router.route_trail import PATH_LABELS
from pdserve.router.scaling_log import ScalingLog

# What generate_latest writes. Not CONTENT_TYPE_LATEST: since prometheus-client 0.22 that says
# version=1.0.0 (UTF-8 names), which some scrapers refuse, and the library itself answers with
# this one unless a scraper asks for 1.0.0.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
NODE_LABELS = ("node_id", "role")

# Process-wide: no `*_created` series next to every counter and histogram (the exposition had
# none before prometheus-client, and nothing reads them).
disable_created_metrics()


class RouterMetrics:
    """Everything /metrics shows; ``render()`` is its body.

    ``nodes`` and ``num_inflight`` are read at each scrape: the registry's live nodes, and the
    router's sub-requests in flight by role.
    """

    def __init__(
        self, nodes: Callable[[], Sequence[NodeInfo]], num_inflight: Callable[[], Mapping[str, int]]
    ) -> None:
        self.registry = CollectorRegistry()  # one per router: tests run several in a process
        self._declare_counters()
        self._declare_outcomes()
        self._declare_waits()
        self._declare_latencies()
        self.registry.register(LiveStateCollector(nodes, num_inflight))
        self.scaling = ScalingLog(self.registry)  # what an autoscaler reports (POST /admin/autoscale)

    def _declare_counters(self) -> None:
        reg = self.registry
        self.requests = Counter(
            "pdserve_requests_total",
            "HTTP requests by endpoint and outcome.",
            ["endpoint", "outcome"],
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens_total", "Prompt tokens of finished samples.", registry=reg
        )
        self.cached_tokens = Counter(
            "pdserve_cached_prompt_tokens_total", "Prompt tokens served from a prefix cache.", registry=reg
        )
        self.generation_tokens = Counter("pdserve_generation_tokens_total", "Generated tokens.", registry=reg)
        self.kv_bytes = Counter(
            "pdserve_kv_transfer_bytes_total", "KV bytes moved, as nodes report them.", registry=reg
        )
        self.lora_requests = Counter(
            "pdserve_lora_requests_total",
            "Requests that named a LoRA adapter, by adapter.",
            ["adapter"],
            registry=reg,
        )
        self.lora_loads = Counter(
            "pdserve_lora_adapters_loaded_total",
            "Adapters added to the router's table (POST /v1/load_lora_adapter), by adapter.",
            ["adapter"],
            registry=reg,
        )

    def _declare_outcomes(self) -> None:
        """Where sub-requests went, and what happened to those that did not go as planned."""
        reg = self.registry
        self.retries = Counter(
            "pdserve_retries_total", "Sub-requests retried on another node pair.", registry=reg
        )
        self.migrations = Counter(
            "pdserve_migrations_total",
            "Samples resumed on another decode node after tokens were sent.",
            registry=reg,
        )
        self.shed = Counter(
            "pdserve_shed_total",
            "Requests refused with 429 before any node took them, by reason: inflight_limit (the "
            "router's bound), ttft_slo (the predicted time to first token passes --ttft-slo-s), "
            "queue_timeout (without an SLO: it passes --chunk-timeout-s).",
            ["reason"],
            registry=reg,
        )
        for reason in (
            "inflight_limit",
            "ttft_slo",
            "queue_timeout",
        ):  # at 0 from the start, for autoscalers' queries
            self.shed.labels(reason=reason)
        self.routes = Counter(
            "pdserve_routes_total",
            "Sub-requests sent to nodes, by where the prompt is prefilled and why (router.policy.Route).",
            ["prefill"],
            registry=reg,
        )
        self.paths = Counter(
            "pdserve_request_paths_total",
            "Samples by the path of the attempt that produced their first token (the x-pdserve-path "
            "header): disaggregated, local-prefill or colocated, and for local-prefill the reason.",
            ["path", "reason"],
            registry=reg,
        )
        for path, why in PATH_LABELS:
            self.paths.labels(path=str(path), reason=str(why or "none"))

    def _declare_waits(self) -> None:
        self.node_waits = Counter(
            "pdserve_node_waits_total",
            "Samples under way (retried or migrating) that found no usable node and waited for one "
            "(--reroute-wait-s), by outcome: found (a node came back or joined), gave_up (the "
            "sample failed). A burst of them is the whole pool's records lapsing at once: a paused "
            "machine, a Redis outage.",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("found", "gave_up"):
            self.node_waits.labels(outcome=outcome)

    def _declare_latencies(self) -> None:
        reg = self.registry
        self.ttft = _latency("pdserve_time_to_first_token_seconds", "Arrival to first token.", reg)
        self.tpot = _latency(
            "pdserve_time_per_output_token_seconds", "Mean time per token after the first.", reg
        )
        self.e2e = _latency("pdserve_e2e_request_latency_seconds", "Arrival to last token, per sample.", reg)
        self.queue = _latency("pdserve_queue_time_seconds", "Arrival to the request leaving the router.", reg)
        self.stages = _latency(
            "pdserve_request_stage_seconds", "Per-sample time in each node stage.", reg, ["stage"]
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _latency(name: str, help_: str, registry: CollectorRegistry, labels: Sequence[str] = ()) -> Histogram:
    return Histogram(name, help_, labels, buckets=LATENCY_BUCKETS, registry=registry)


class LiveStateCollector(Collector):
    """Gauges of the router's in-flight sub-requests and of every node's load, and each node's
    engine-step series, computed from the live state at each scrape. The node series lag by a
    heartbeat: they are what the node last reported."""

    def __init__(
        self, nodes: Callable[[], Sequence[NodeInfo]], num_inflight: Callable[[], Mapping[str, int]]
    ) -> None:
        self._nodes = nodes
        self._num_inflight = num_inflight

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "pdserve_router_inflight_requests", "Sub-requests in flight by role.", labels=["role"]
        )
        for role, num in sorted(self._num_inflight().items()):
            inflight.add_metric([role], num)
        yield inflight
        nodes = self._nodes()
        yield from _node_gauges(nodes)
        yield from node_step_metrics(nodes)
        yield from node_speculation_metrics(nodes)
        yield from node_offload_metrics(nodes)
        yield from node_adapter_metrics(nodes)


_NODE_GAUGES = (
    (
        "pdserve_node_kv_blocks_used",
        "KV blocks held by live requests.",
        lambda n: n.num_blocks_total - n.num_blocks_free,
    ),
    (
        "pdserve_node_kv_blocks_cached",
        "Free KV blocks that still hold prefix cache (evictable).",
        lambda n: n.num_blocks_cached,
    ),
    ("pdserve_node_kv_blocks_total", "KV blocks in the pool.", lambda n: n.num_blocks_total),
    (
        "pdserve_node_status_timestamp_seconds",
        "Wall-clock time the node computed the status these node gauges show (they lag by a heartbeat).",
        lambda n: n.heartbeat_time,
    ),
    ("pdserve_node_running_requests", "Requests in the running batch.", lambda n: n.num_running),
    ("pdserve_node_queued_requests", "Requests waiting on the node.", lambda n: n.num_queued),
    (
        "pdserve_node_queued_prefill_tokens",
        "Prompt tokens not yet computed.",
        lambda n: n.num_queued_prefill_tokens,
    ),
)


def _node_gauges(nodes: Sequence[NodeInfo]) -> Iterator[GaugeMetricFamily]:
    """Every node's load by node_id and role; a gauge a node does not report has no sample."""
    for name, help_, value in _NODE_GAUGES:
        yield _node_gauge(name, help_, ((n, value(n)) for n in nodes))
    yield _node_gauge(
        "pdserve_node_kv_blocks_committed",
        "KV blocks whose memory is committed (a CPU pool commits as it is used and while the node is idle).",
        ((n, n.num_blocks_committed) for n in nodes if n.num_blocks_committed is not None),
    )
    yield _node_gauge(
        "pdserve_node_torch_threads",
        "Torch threads the node's engine computes with now (fewer while other processes load its CPUs).",
        ((n, n.torch_threads) for n in nodes if n.torch_threads is not None),
    )
    yield _node_gauge(
        "pdserve_node_prefill_tokens_per_second",
        "Prompt tokens a node computes per second of engine step, as it measured them recently (a "
        "prompt timed at start, then its steps of 64+ prompt tokens): what the router divides the "
        "node's prompt queue by to predict a first token, and sheds by.",
        ((n, n.prefill_tokens_per_s) for n in nodes if n.prefill_tokens_per_s),
    )
    prefills = [n for n in nodes if n.role is Role.PREFILL]
    yield _node_gauge(
        "pdserve_node_prefill_backlog_seconds",
        "Queued prompt tokens over the node's measured "
        "prefill speed (the pool's mean for a node without one yet): what autoscales prefill.",
        prefill_backlog_seconds(prefills),
    )


def _node_gauge(name: str, help_: str, samples: Iterable[tuple[NodeInfo, float]]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, help_, labels=NODE_LABELS)
    for node, value in samples:
        gauge.add_metric(_node_labels(node), value)
    return gauge


def node_speculation_metrics(nodes: Sequence[NodeInfo]) -> Iterator[CounterMetricFamily]:
    """Speculative decoding's draft tokens, proposed and accepted, per node that speculates: the
    acceptance rate is the ratio of their rates."""
    families = (
        (
            "pdserve_node_spec_draft_tokens_total",
            "Draft tokens verified (speculative decoding).",
            "proposed_tokens",
        ),
        (
            "pdserve_node_spec_accepted_tokens_total",
            "Draft tokens accepted (speculative decoding).",
            "accepted_tokens",
        ),
    )
    for name, help_, key in families:
        counter = CounterMetricFamily(name.removesuffix("_total"), help_, labels=NODE_LABELS)
        for node in nodes:
            value = (node.speculation or {}).get(key)
            if isinstance(value, int):
                counter.add_metric(_node_labels(node), value)
        yield counter


OFFLOAD_COUNTERS = (
    ("stored_blocks", "KV blocks written to the node's offload folder."),
    ("loaded_blocks", "KV blocks loaded from the offload tier instead of recomputed."),
    ("skipped_saves", "KV blocks not kept: the tier's pending copies were at their bound."),
    ("corrupt_blocks", "Offload tier blocks that failed a check: deleted and recomputed, never served."),
    ("timed_out_prefetches", "Requests that stopped waiting for their offloaded blocks and recomputed."),
    ("evicted_blocks", "Offload tier blocks removed for the folder's budget."),
)


def node_offload_metrics(nodes: Sequence[NodeInfo]) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The KV offload tier of each node that has one (engine/offload/): its counters, and the
    blocks and bytes its folder holds now."""
    tiered = [node for node in nodes if node.kv_offload]
    for key, help_ in OFFLOAD_COUNTERS:
        counter = CounterMetricFamily(f"pdserve_node_kv_offload_{key}", help_, labels=NODE_LABELS)
        for node in tiered:
            counter.add_metric(_node_labels(node), (node.kv_offload or {}).get(key, 0))
        yield counter
    for key, help_ in (
        ("disk_blocks", "KV blocks in the node's offload folder."),
        ("disk_bytes", "Bytes of them."),
    ):
        gauge = GaugeMetricFamily(f"pdserve_node_kv_offload_{key}", help_, labels=NODE_LABELS)
        for node in tiered:
            gauge.add_metric(_node_labels(node), (node.kv_offload or {}).get(key, 0))
        yield gauge


def node_adapter_metrics(nodes: Sequence[NodeInfo]) -> Iterator[CounterMetricFamily]:
    """Per node and LoRA adapter: the requests it took with it, the times it read it into a slot,
    and the times it was evicted from one for another (engine/lora: --max-loras slots, LRU)."""
    families = (
        ("pdserve_node_lora_requests_total", "Requests run with a LoRA adapter.", "requests"),
        ("pdserve_node_lora_loads_total", "LoRA adapters read into a slot.", "loads"),
        ("pdserve_node_lora_evictions_total", "LoRA adapters evicted from their slot.", "evictions"),
    )
    for name, help_, key in families:
        counter = CounterMetricFamily(name.removesuffix("_total"), help_, labels=[*NODE_LABELS, "adapter"])
        for node in nodes:
            for adapter, counts in sorted((node.adapter_counts or {}).items()):
                value = counts.get(key) if isinstance(counts, dict) else None
                if isinstance(value, int):
                    counter.add_metric([*_node_labels(node), adapter], value)
        yield counter


def node_step_metrics(nodes: Sequence[NodeInfo]) -> tuple[HistogramMetricFamily, CounterMetricFamily]:
    """Each node's engine steps by kind (engine/core/step_stats.py), as a histogram of step seconds and
    a token counter. They count from the node's start and lag by a heartbeat, like the gauges."""
    steps = HistogramMetricFamily(
        "pdserve_node_engine_step_seconds",
        "Engine step wall time by kind (prefill, decode or mixed rows): what decode rows' TPOT is made of.",
        labels=(*NODE_LABELS, "kind"),
    )
    tokens = CounterMetricFamily(
        "pdserve_node_engine_tokens_total",
        "Tokens engine steps computed, by step kind and phase.",
        labels=(*NODE_LABELS, "kind", "phase"),
    )
    for node in nodes:
        for kind, c in sorted(node.step_stats.items()):
            try:
                counts = [int(n) for n in c["buckets"]]  # per bucket, not cumulative
                seconds, num_steps = float(c["seconds"]), int(c["steps"])
                phases = {"prompt": float(c["prompt_tokens"]), "decode": float(c["decode_tokens"])}
            except (KeyError, TypeError, ValueError):  # a node of another version: left out
                continue
            if len(counts) != len(BUCKETS_S):
                continue
            labels = [*_node_labels(node), kind]
            steps.add_metric(labels, _cumulative(counts, num_steps), seconds)
            for phase, num in phases.items():
                tokens.add_metric([*labels, phase], num)
    return steps, tokens


def _cumulative(counts: Sequence[int], total: int) -> list[tuple[str, float]]:
    """(le, steps at or under it) per bound of BUCKETS_S, then +Inf: every step."""
    buckets, running = [], 0
    for bound, num in zip(BUCKETS_S, counts, strict=True):
        running += num
        buckets.append((floatToGoString(bound), running))  # le as prometheus-client's Histogram writes it
    return [*buckets, ("+Inf", total)]


def _node_labels(node: NodeInfo) -> list[str]:
    return [node.node_id, node.role.value]


def prefill_backlog_seconds(prefills: Sequence[NodeInfo]) -> list[tuple[NodeInfo, float]]:
    """Per prefill node: seconds its queued prompt tokens take at its measured speed.

    A node that has not measured its speed yet (just started) is given the pool's mean speed; an
    empty queue is 0 s whatever the speed. A node with a queue and no speed in the whole pool to
    go by has no sample: an autoscaler then sees the others' (or none) rather than a guess.
    """
    speeds = [n.prefill_tokens_per_s for n in prefills if n.prefill_tokens_per_s]
    pool_speed = sum(speeds) / len(speeds) if speeds else None
    out = []
    for node in prefills:
        speed = node.prefill_tokens_per_s or pool_speed
        if node.num_queued_prefill_tokens == 0:
            out.append((node, 0.0))
        elif speed:
            out.append((node, node.num_queued_prefill_tokens / speed))
    return out
