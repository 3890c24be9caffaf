"""Prometheus metrics in the text exposition format (version 0.0.4), without a client library.

Counters and histograms are kept here; node gauges are read from the registry at scrape time.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Sequence

from engine.step_stats import BUCKETS_S
from protocol.registry import NodeInfo, Role

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

Labels = tuple[tuple[str, str], ...]
_INF = 'le="+Inf"'


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclasses.dataclass(slots=True)
class Counter:
    name: str  # ends in _total
    help: str
    values: dict[Labels, float] = dataclasses.field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        lines += [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        return lines


@dataclasses.dataclass(slots=True)
class _Series:
    bucket_counts: list[int]  # per upper bound, not cumulative
    sum: float = 0.0
    count: int = 0


@dataclasses.dataclass(slots=True)
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS  # upper bounds, ascending; +Inf is implied
    series: dict[Labels, _Series] = dataclasses.field(default_factory=dict)

    def observe(self, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        series = self.series.setdefault(key, _Series([0] * len(self.buckets)))
        index = bisect.bisect_left(self.buckets, value)
        if index < len(self.buckets):
            series.bucket_counts[index] += 1
        series.sum += value
        series.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, series in sorted(self.series.items()):
            cumulative = 0
            for bound, num in zip(self.buckets, series.bucket_counts, strict=True):
                cumulative += num
                le = 'le="' + _num(bound) + '"'
                lines.append(f"{self.name}_bucket{_labels(key, le)} {cumulative}")
            lines.append(f"{self.name}_bucket{_labels(key, _INF)} {series.count}")
            lines.append(f"{self.name}_sum{_labels(key)} {_num(series.sum)}")
            lines.append(f"{self.name}_count{_labels(key)} {series.count}")
        return lines


def _gauge(name: str, help_: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
    return lines + [f"{name}{_labels(k)} {_num(v)}" for k, v in samples]


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = Counter("pdserve_requests_total", "HTTP requests by endpoint and outcome.")
        self.prompt_tokens = Counter("pdserve_prompt_tokens_total", "Prompt tokens of finished samples.")
        self.cached_tokens = Counter(
            "pdserve_cached_prompt_tokens_total", "Prompt tokens served from a prefix cache."
        )
        self.generation_tokens = Counter("pdserve_generation_tokens_total", "Generated tokens.")
        self.retries = Counter("pdserve_retries_total", "Sub-requests retried on another node pair.")
        self.migrations = Counter(
            "pdserve_migrations_total", "Samples resumed on another decode node after tokens were sent."
        )
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes_total", "KV bytes moved, as nodes report them.")
        self.routes = Counter(
            "pdserve_routes_total",
            "Sub-requests sent to nodes, by where the prompt is prefilled and why (router.policy.Route).",
        )
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first token.")
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Mean time per token after the first.")
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to last token, per sample.")
        self.queue = Histogram("pdserve_queue_time_seconds", "Arrival to the request leaving the router.")
        self.stages = Histogram("pdserve_request_stage_seconds", "Per-sample time in each node stage.")

    def render(self, nodes: Sequence[NodeInfo], num_inflight: dict[str, int]) -> str:
        lines: list[str] = []
        for metric in (
            self.requests,
            self.prompt_tokens,
            self.cached_tokens,
            self.generation_tokens,
            self.retries,
            self.migrations,
            self.kv_bytes,
            self.routes,
            self.ttft,
            self.tpot,
            self.e2e,
            self.queue,
            self.stages,
        ):
            lines += metric.render()
        lines += _gauge(
            "pdserve_router_inflight_requests",
            "Sub-requests in flight by role.",
            [((("role", role),), num) for role, num in sorted(num_inflight.items())],
        )
        lines += _node_gauges(nodes)
        lines += node_step_metrics(nodes)
        return "\n".join(lines) + "\n"


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


def _node_gauges(nodes: Sequence[NodeInfo]) -> list[str]:
    lines: list[str] = []
    for name, help_, value in _NODE_GAUGES:
        lines += _gauge(name, help_, (((("node_id", n.node_id), ("role", n.role)), value(n)) for n in nodes))
    lines += _gauge(
        "pdserve_node_kv_blocks_committed",
        "KV blocks whose memory is committed (a CPU pool commits as it is used and while the node is idle).",
        ((_node_labels(n), n.num_blocks_committed) for n in nodes if n.num_blocks_committed is not None),
    )
    lines += _gauge(
        "pdserve_node_torch_threads",
        "Torch threads the node's engine computes with now (fewer while other processes load its CPUs).",
        ((_node_labels(n), n.torch_threads) for n in nodes if n.torch_threads is not None),
    )
    prefills = [n for n in nodes if n.role is Role.PREFILL]
    lines += _gauge(
        "pdserve_node_prefill_tokens_per_second",
        "Prompt tokens a prefill node computes per second of engine step, as it measured them recently.",
        ((_node_labels(n), n.prefill_tokens_per_s) for n in prefills if n.prefill_tokens_per_s),
    )
    lines += _gauge(
        "pdserve_node_prefill_backlog_seconds",
        "Queued prompt tokens over the node's measured "
        "prefill speed (the pool's mean for a node without one yet): what autoscales prefill.",
        ((_node_labels(n), seconds) for n, seconds in prefill_backlog_seconds(prefills)),
    )
    return lines


def node_step_metrics(nodes: Sequence[NodeInfo]) -> list[str]:
    """Each node's engine steps by kind (engine/step_stats.py), as a histogram of step seconds and
    a token counter. They count from the node's start and lag by a heartbeat, like the gauges."""
    steps = Histogram(
        "pdserve_node_engine_step_seconds",
        "Engine step wall time by kind (prefill, decode or mixed rows): what decode rows' TPOT is made of.",
        BUCKETS_S,
    )
    tokens = Counter(
        "pdserve_node_engine_tokens_total", "Tokens engine steps computed, by step kind and phase."
    )
    for node in nodes:
        for kind, c in sorted(node.step_stats.items()):
            try:
                series = _Series([int(n) for n in c["buckets"]], float(c["seconds"]), int(c["steps"]))
                phases = {"prompt": float(c["prompt_tokens"]), "decode": float(c["decode_tokens"])}
            except (KeyError, TypeError, ValueError):  # a node of another version: left out
                continue
            if len(series.bucket_counts) != len(BUCKETS_S):
                continue
            key = (*_node_labels(node), ("kind", kind))
            steps.series[key] = series
            for phase, num in phases.items():
                tokens.values[(*key, ("phase", phase))] = num
    return steps.render() + tokens.render()


def _node_labels(node: NodeInfo) -> Labels:
    return (("node_id", node.node_id), ("role", node.role))


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
