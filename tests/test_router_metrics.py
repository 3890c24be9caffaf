"""The router's /metrics: prometheus-client's exposition of the same families, types and labels as
the hand-written one it replaced (what deploy/k8s, bench_serve and the tests read)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.core.step_stats import BUCKETS_S
from pdserve.protocol import messages as pm
from pdserve.router.metrics import LATENCY_BUCKETS, RouterMetrics
from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import LONG_PROMPT, TEXT, FakeNode, fake_cluster, node_info, run_async

Series = tuple[str, frozenset[tuple[str, str]]]  # sample name, labels


def _samples(text: str) -> dict[Series, float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _render(nodes=(), num_inflight=None) -> str:
    return RouterMetrics(lambda: nodes, lambda: num_inflight or {}).render().decode()


def test_counters_keep_their_total_names_and_sorted_escaped_labels_without_created_series():
    metrics = RouterMetrics(lambda: [], lambda: {})
    metrics.requests.labels(endpoint="/v1/a", outcome="200").inc()
    metrics.requests.labels(endpoint='/v1/"b"', outcome="400").inc(2)
    lines = metrics.render().decode().splitlines()
    assert "# TYPE pdserve_requests_total counter" in lines
    assert 'pdserve_requests_total{endpoint="/v1/a",outcome="200"} 1.0' in lines
    assert 'pdserve_requests_total{endpoint="/v1/\\"b\\"",outcome="400"} 2.0' in lines
    assert not [line for line in lines if "_created" in line]


def test_histograms_keep_their_bucket_bounds_cumulative_with_inf_sum_and_count():
    metrics = RouterMetrics(lambda: [], lambda: {})
    for value in (0.005, 0.007, 0.5, 300.0):  # a value on a bound counts in that bucket
        metrics.ttft.observe(value)
    buckets = {
        float(dict(labels)["le"]): value
        for (name, labels), value in _samples(metrics.render().decode()).items()
        if name == "pdserve_time_to_first_token_seconds_bucket"
    }
    assert list(buckets) == [*LATENCY_BUCKETS, float("inf")]
    assert [buckets[0.005], buckets[0.01], buckets[0.25], buckets[0.5], buckets[120.0]] == [1, 2, 2, 3, 3]
    assert buckets[float("inf")] == 4
    text = metrics.render().decode()
    assert "pdserve_time_to_first_token_seconds_count 4.0" in text.splitlines()
    assert _samples(text)["pdserve_time_to_first_token_seconds_sum", frozenset()] == pytest.approx(300.512)


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
            speculation={"proposed_tokens": 90, "accepted_tokens": 55, "drafted_steps": 30},
            kv_offload={"loaded_blocks": 12, "corrupt_blocks": 1, "disk_blocks": 40, "disk_bytes": 4096},
        ),
        node_info("p0", "prefill", num_queued=4),  # an older node: says neither
    ]
    text = _render(nodes, {"decode": 2, "prefill": 1})
    lines = text.splitlines()
    assert 'pdserve_node_kv_blocks_used{node_id="d0",role="decode"} 30.0' in lines
    assert 'pdserve_node_kv_blocks_cached{node_id="d0",role="decode"} 20.0' in lines
    assert 'pdserve_node_kv_blocks_total{node_id="p0",role="prefill"} 100.0' in lines
    assert 'pdserve_node_running_requests{node_id="d0",role="decode"} 3.0' in lines
    assert 'pdserve_node_kv_blocks_committed{node_id="d0",role="decode"} 45.0' in lines
    assert 'pdserve_node_torch_threads{node_id="d0",role="decode"} 1.0' in lines
    assert not any(
        line.startswith(("pdserve_node_kv_blocks_committed", "pdserve_node_torch_threads")) and "p0" in line
        for line in lines
    )
    assert 'pdserve_node_queued_requests{node_id="p0",role="prefill"} 4.0' in lines
    assert 'pdserve_node_spec_draft_tokens_total{node_id="d0",role="decode"} 90.0' in lines
    assert 'pdserve_node_spec_accepted_tokens_total{node_id="d0",role="decode"} 55.0' in lines
    assert not any(line.startswith("pdserve_node_spec") and "p0" in line for line in lines)
    assert 'pdserve_node_kv_offload_loaded_blocks_total{node_id="d0",role="decode"} 12.0' in lines
    assert 'pdserve_node_kv_offload_corrupt_blocks_total{node_id="d0",role="decode"} 1.0' in lines
    assert 'pdserve_node_kv_offload_disk_blocks{node_id="d0",role="decode"} 40.0' in lines
    assert not any(line.startswith("pdserve_node_kv_offload") and "p0" in line for line in lines)
    assert 'pdserve_router_inflight_requests{role="decode"} 2.0' in lines
    assert text.endswith("\n")


def test_node_gauges_follow_the_live_state_at_each_scrape():
    nodes = [node_info("d0", "decode", num_running=1)]
    metrics = RouterMetrics(lambda: nodes, lambda: {})
    assert 'pdserve_node_running_requests{node_id="d0",role="decode"} 1.0' in metrics.render().decode()
    nodes[0] = node_info("d0", "decode", num_running=5)
    assert 'pdserve_node_running_requests{node_id="d0",role="decode"} 5.0' in metrics.render().decode()
    nodes.clear()
    assert "pdserve_node_running_requests{" not in metrics.render().decode()


def test_two_routers_in_one_process_count_apart():
    first, second = RouterMetrics(lambda: [], lambda: {}), RouterMetrics(lambda: [], lambda: {})
    first.retries.inc()
    assert "pdserve_retries_total 1.0" in first.render().decode().splitlines()
    assert "pdserve_retries_total 0.0" in second.render().decode().splitlines()


# ---------------------------------------------------------------- the whole exposition, end to end

# Every family /metrics had before prometheus-client: name, type, and the label names of its
# samples (le on histogram buckets), from a run like the one below through the hand-written code.
NODE = frozenset({"node_id", "role"})
LATENCY = ("histogram", frozenset())
EXPECTED = {
    "pdserve_requests": ("counter", frozenset({"endpoint", "outcome"})),
    "pdserve_prompt_tokens": ("counter", frozenset()),
    "pdserve_cached_prompt_tokens": ("counter", frozenset()),
    "pdserve_generation_tokens": ("counter", frozenset()),
    "pdserve_retries": ("counter", frozenset()),
    "pdserve_shed": ("counter", frozenset({"reason"})),
    "pdserve_node_waits": ("counter", frozenset({"outcome"})),
    "pdserve_migrations": ("counter", frozenset()),
    "pdserve_kv_transfer_bytes": ("counter", frozenset()),
    "pdserve_routes": ("counter", frozenset({"prefill"})),
    "pdserve_request_paths": ("counter", frozenset({"path", "reason"})),
    "pdserve_time_to_first_token_seconds": LATENCY,
    "pdserve_time_per_output_token_seconds": LATENCY,
    "pdserve_e2e_request_latency_seconds": LATENCY,
    "pdserve_queue_time_seconds": LATENCY,
    "pdserve_request_stage_seconds": ("histogram", frozenset({"stage"})),
    "pdserve_router_inflight_requests": ("gauge", frozenset({"role"})),
    # added since: what `pdserve up --autoscale` reports (no target until a decision is reported)
    "pdserve_autoscale_decisions": ("counter", frozenset({"kind"})),
    "pdserve_autoscale_target_nodes": ("gauge", frozenset()),
    "pdserve_autoscale_prefill_scale": ("gauge", frozenset()),
    "pdserve_node_kv_blocks_used": ("gauge", NODE),
    "pdserve_node_kv_blocks_cached": ("gauge", NODE),
    "pdserve_node_kv_blocks_total": ("gauge", NODE),
    "pdserve_node_status_timestamp_seconds": ("gauge", NODE),
    "pdserve_node_running_requests": ("gauge", NODE),
    "pdserve_node_queued_requests": ("gauge", NODE),
    "pdserve_node_queued_prefill_tokens": ("gauge", NODE),
    "pdserve_node_kv_blocks_committed": ("gauge", NODE),
    "pdserve_node_torch_threads": ("gauge", NODE),
    "pdserve_node_prefill_tokens_per_second": ("gauge", NODE),
    "pdserve_node_prefill_backlog_seconds": ("gauge", NODE),
    "pdserve_node_engine_step_seconds": ("histogram", NODE | {"kind"}),
    "pdserve_node_engine_tokens": ("counter", NODE | {"kind", "phase"}),
    # speculative decoding (samples only from nodes that speculate: none in this run)
    "pdserve_node_spec_draft_tokens": ("counter", frozenset()),
    "pdserve_node_spec_accepted_tokens": ("counter", frozenset()),
    # LoRA adapters (labelled samples only once a request names one: none in this run)
    "pdserve_lora_requests": ("counter", frozenset()),
    "pdserve_lora_adapters_loaded": ("counter", frozenset()),
    "pdserve_node_lora_requests": ("counter", frozenset()),
    "pdserve_node_lora_loads": ("counter", frozenset()),
    "pdserve_node_lora_evictions": ("counter", frozenset()),
    # the KV offload tier (samples only from nodes that have one: none in this run)
    **{
        f"pdserve_node_kv_offload_{k}": ("counter", frozenset())
        for k in (
            "stored_blocks",
            "loaded_blocks",
            "skipped_saves",
            "corrupt_blocks",
            "timed_out_prefetches",
            "evicted_blocks",
        )
    },
    "pdserve_node_kv_offload_disk_blocks": ("gauge", frozenset()),
    "pdserve_node_kv_offload_disk_bytes": ("gauge", frozenset()),
}


class _TimedNode(FakeNode):
    """A fake node whose first token carries stage timings and KV bytes, as real nodes' do."""

    def _chunk(self, req, index, is_first):
        chunk = super()._chunk(req, index, is_first)
        timings = pm.StageTimings(prefill_queue=0.01, prefill_compute=0.2, kv_bytes=4096)
        return dataclasses.replace(chunk, timings=timings) if is_first else chunk


def _steps(num: int) -> dict:
    buckets = [0] * len(BUCKETS_S)
    buckets[3] = num
    return {
        "steps": num,
        "seconds": 0.05 * num,
        "prompt_tokens": 10 * num,
        "decode_tokens": num,
        "buckets": buckets,
    }


@pytest.fixture(scope="module")
def scrape(default_model_dir) -> httpx.Response:
    """/metrics of the real router after a disaggregated, a short, a refused and a streamed request."""
    tokens = Tokenizer(default_model_dir).encode(TEXT)
    nodes = [
        _TimedNode(
            "p0",
            "prefill",
            tokens,
            num_cached_tokens=4,
            prefill_tokens_per_s=100.0,
            num_queued_prefill_tokens=50,
            step_stats={"prefill": _steps(3)},
        ),
        _TimedNode(
            "d0",
            "decode",
            tokens,
            num_blocks_committed=40,
            torch_threads=2,
            step_stats={"decode": _steps(5), "mixed": _steps(1)},
        ),
    ]
    chat = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 4, "stream": True}

    async def go() -> httpx.Response:
        async with fake_cluster(default_model_dir, nodes) as cluster, httpx.AsyncClient() as http:
            url = cluster.base_url
            for body in (
                {"prompt": LONG_PROMPT, "max_tokens": 3},
                {"prompt": "Hi", "max_tokens": 2},
                {"prompt": "Hi", "max_tokens": -1},
            ):
                await http.post(url + "/v1/completions", json=body, timeout=30)
            await http.post(url + "/v1/chat/completions", json=chat, timeout=30)
            return await http.get(url + "/metrics")

    return run_async(go())


def test_exposition_has_every_family_type_and_label_set_it_had_before(scrape):
    assert scrape.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = list(text_string_to_metric_families(scrape.text))
    found = {}
    for family in families:
        label_names = {name for s in family.samples for name in s.labels} - {"le"}
        found[family.name] = (family.type, frozenset(label_names))
    assert found == EXPECTED
    assert not [s.name for f in families for s in f.samples if s.name.endswith("_created")]


def test_exposition_keeps_the_label_values_and_counts_of_the_run(scrape):
    samples = _samples(scrape.text)

    def value(name: str, **labels: str) -> float:
        return samples[name, frozenset(labels.items())]

    assert value("pdserve_requests_total", endpoint="/v1/completions", outcome="200") == 2
    assert value("pdserve_requests_total", endpoint="/v1/completions", outcome="400") == 1
    assert value("pdserve_routes_total", prefill="prefill_node") == 2
    assert value("pdserve_routes_total", prefill="short") == 1
    assert value("pdserve_kv_transfer_bytes_total") == 3 * 4096
    assert value("pdserve_request_stage_seconds_count", stage="prefill_queue") == 3
    d0 = {"node_id": "d0", "role": "decode"}
    assert value("pdserve_node_engine_tokens_total", **d0, kind="mixed", phase="prompt") == 10
    assert value("pdserve_node_engine_step_seconds_count", **d0, kind="decode") == 5
    # 50 queued prompt tokens at 100 tokens/s
    assert value("pdserve_node_prefill_backlog_seconds", node_id="p0", role="prefill") == 0.5
    le = {
        float(dict(labels)["le"])
        for (name, labels), _ in samples.items()
        if name == "pdserve_node_engine_step_seconds_bucket"
    }
    assert le == {*BUCKETS_S, float("inf")}
