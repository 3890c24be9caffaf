"""The engine's step counts by kind (engine/core/step_stats.py) and their Prometheus form on the router."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench_serve.server_steps import StepLine, difference, parse
from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.step_stats import BUCKETS_S, StepStats
from pdserve.engine.llm_engine import LLMEngine
from pdserve.router.metrics import RouterMetrics
from tests.test_router_support import node_info
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def path() -> str:
    return str(make_tiny_model("llama"))


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int], start: int = 0) -> int:
    """Adds the requests, a new one every other step from ``start`` on; returns the steps run."""
    steps, pending = 0, list(enumerate(zip(prompts, max_tokens, strict=True)))
    while pending or engine.has_work():
        if pending and steps >= start and steps % 2 == 0:
            i, (prompt, n) = pending.pop(0)
            engine.add_request(
                f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            )
        engine.step()
        steps += 1
    return steps


def test_steps_are_counted_by_kind_with_every_computed_token(path):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (37, 23, 41, 30, 9)]
    max_tokens = [12, 5, 9, 1, 7]
    config = EngineConfig(
        model=path, num_kv_blocks=256, block_size=8, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    engine = LLMEngine(config)
    steps = _run(engine, prompts, max_tokens)
    stats = engine.step_stats.by_kind
    # staggered arrivals and a 16-token budget: prompt chunks alone, decodes alone, and both at once
    assert all(stats[kind].steps > 0 for kind in ("prefill", "decode", "mixed"))
    assert sum(c.steps for c in stats.values()) == steps  # no step went uncounted
    assert sum(c.prompt_tokens for c in stats.values()) == sum(map(len, prompts))
    # the last prompt token's row samples the first output token; each further one is a decode row
    assert sum(c.decode_tokens for c in stats.values()) == sum(n - 1 for n in max_tokens)
    assert stats["prefill"].decode_tokens == 0 and stats["decode"].prompt_tokens == 0
    for c in stats.values():
        assert c.seconds > 0 and sum(c.buckets) == c.steps  # no tiny-model step takes 5 s
        assert c.prompt_tokens + c.decode_tokens <= 16 * c.steps  # the budget holds
    snapshot = engine.step_stats.snapshot()
    assert set(snapshot) == {"prefill", "decode", "mixed"}
    assert snapshot["mixed"]["steps"] == stats["mixed"].steps


def test_prompt_tokens_a_prefix_hit_covers_are_not_counted(path):
    """A prefix-cache hit computes nothing for the blocks it covers: only computed tokens count."""
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 256, (40,), generator=g).tolist()
    config = EngineConfig(model=path, num_kv_blocks=64, block_size=8, enable_prefix_caching=True)
    engine = LLMEngine(config)
    _run(engine, [prompt, prompt], [4, 4])
    stats = engine.step_stats.by_kind
    cached = 32  # the second request reuses the first's four full blocks; the last token's block runs
    assert sum(c.prompt_tokens for c in stats.values()) == 2 * 40 - cached
    assert sum(c.decode_tokens for c in stats.values()) == 2 * 3


def test_an_empty_step_is_not_a_step():
    stats = StepStats()
    stats.observe(0, 0, 0.5)
    assert stats.snapshot() == {}


def test_router_renders_each_nodes_steps_as_a_histogram_and_token_counter():
    stats = {
        "decode": {"steps": 5, "seconds": 0.2, "prompt_tokens": 0, "decode_tokens": 40, "buckets": [0] * 10},
        "mixed": {"steps": 2, "seconds": 1.5, "prompt_tokens": 300, "decode_tokens": 9, "buckets": [0] * 10},
    }
    stats["decode"]["buckets"][BUCKETS_S.index(0.05)] = 5
    stats["mixed"]["buckets"][BUCKETS_S.index(1.0)] = 2
    broken = {"decode": {"steps": 1}, "mixed": {**stats["mixed"], "buckets": [1, 1]}}
    text = _scrape(
        [node_info("d0", "decode", step_stats=stats), node_info("d1", "decode", step_stats=broken)]
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[name, tuple(sorted({"node_id": "d0", "role": "decode", **labels}.items()))]

    name = "pdserve_node_engine_step_seconds"
    assert value(f"{name}_bucket", kind="decode", le="0.025") == 0
    assert value(f"{name}_bucket", kind="decode", le="0.05") == 5
    assert value(f"{name}_bucket", kind="mixed", le="0.5") == 0
    assert value(f"{name}_bucket", kind="mixed", le="+Inf") == 2
    assert value(f"{name}_sum", kind="mixed") == 1.5
    assert value(f"{name}_count", kind="decode") == 5
    assert value("pdserve_node_engine_tokens_total", kind="mixed", phase="prompt") == 300
    assert value("pdserve_node_engine_tokens_total", kind="mixed", phase="decode") == 9
    # records it cannot read are left out
    assert not [
        key for key in samples if key[0].startswith("pdserve_node_engine_") and ("node_id", "d1") in key[1]
    ]


def _scrape(nodes: list) -> str:
    """The router's /metrics body for these node records."""
    return RouterMetrics(lambda: nodes, lambda: {}).render().decode()


def _counts(steps: int, seconds: float, prompt: int, decode: int) -> dict:
    buckets = [0] * len(BUCKETS_S)
    buckets[-1] = steps
    return {
        "steps": steps,
        "seconds": seconds,
        "prompt_tokens": prompt,
        "decode_tokens": decode,
        "buckets": buckets,
    }


def test_bench_serve_takes_each_nodes_difference_and_a_restarted_nodes_counts_since_its_restart():
    def scrape(d0: dict, d1: dict) -> str:
        return _scrape([node_info("d0", "decode", step_stats=d0), node_info("d1", "decode", step_stats=d1)])

    before = parse(scrape({"decode": _counts(100, 4.0, 0, 800)}, {"decode": _counts(50, 2.0, 0, 400)}))
    after = parse(  # d0 went on; d1 restarted and has stepped 10 times since
        scrape(
            {"decode": _counts(130, 5.5, 0, 1040), "mixed": _counts(3, 0.6, 500, 20)},
            {"decode": _counts(10, 0.5, 0, 60)},
        )
    )
    assert difference(before, after) == [
        StepLine("decode", "decode", 40, pytest.approx(2.0), 0, 300),
        StepLine("decode", "mixed", 3, pytest.approx(0.6), 500, 20),
    ]
