"""Prometheus text exposition of the router metrics."""

from __future__ import annotations

from router.metrics import Counter, Histogram, RouterMetrics
from tests.test_router_support import node_info


def test_counter_renders_labels_sorted_and_escaped():
    counter = Counter("x_total", "Things.")
    counter.inc(endpoint="/v1/a", outcome="200")
    counter.inc(2, outcome="400", endpoint='/v1/"b"')
    assert counter.render() == [
        "# HELP x_total Things.",
        "# TYPE x_total counter",
        'x_total{endpoint="/v1/\\"b\\"",outcome="400"} 2',
        'x_total{endpoint="/v1/a",outcome="200"} 1',
    ]


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count():
    histogram = Histogram("t_seconds", "Time.", buckets=(0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    assert histogram.render() == [
        "# HELP t_seconds Time.",
        "# TYPE t_seconds histogram",
        't_seconds_bucket{le="0.1"} 2',
        't_seconds_bucket{le="1"} 3',
        't_seconds_bucket{le="+Inf"} 4',
        "t_seconds_sum 3.65",
        "t_seconds_count 4",
    ]


def test_router_metrics_include_node_gauges_by_id_and_role():
    nodes = [
        node_info(
            "d0",
            "decode",
            num_blocks_total=100,
            num_blocks_free=70,
            num_blocks_cached=20,
            num_running=3,
            num_blocks_committed=45,
            torch_threads=1,
        ),
        node_info("p0", "prefill", num_queued=4),  # an older node: says neither
    ]
    text = RouterMetrics().render(nodes, {"decode": 2, "prefill": 1})
    lines = text.splitlines()
    assert 'pdserve_node_kv_blocks_used{node_id="d0",role="decode"} 30' in lines
    assert 'pdserve_node_kv_blocks_cached{node_id="d0",role="decode"} 20' in lines
    assert 'pdserve_node_kv_blocks_total{node_id="p0",role="prefill"} 100' in lines
    assert 'pdserve_node_running_requests{node_id="d0",role="decode"} 3' in lines
    assert 'pdserve_node_kv_blocks_committed{node_id="d0",role="decode"} 45' in lines
    assert 'pdserve_node_torch_threads{node_id="d0",role="decode"} 1' in lines
    assert not any(
        line.startswith(("pdserve_node_kv_blocks_committed", "pdserve_node_torch_threads")) and "p0" in line
        for line in lines
    )
    assert 'pdserve_node_queued_requests{node_id="p0",role="prefill"} 4' in lines
    assert 'pdserve_router_inflight_requests{role="decode"} 2' in lines
    assert text.endswith("\n")
    for line in lines:  # every sample line is "name{labels} value" or "name value"
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2
