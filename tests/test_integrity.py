"""Invariant checks: the scheduler's cheap ones every step, the engine's full block-pool check in
debug mode, and a node whose check fails says so in its registry record instead of serving on."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cli.status import render
from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.node.log import EventLog
from pdserve.node.options import NodeOptions
from pdserve.node.runtime import NodeRuntime
from pdserve.protocol.registry import list_nodes
from tests.cluster import RedisServer
from tests.test_status import PREFILL
from tests.tiny_models import make_tiny_model


def _engine(debug_checks: bool) -> LLMEngine:
    config = EngineConfig(
        model=str(make_tiny_model("llama")), num_kv_blocks=16, block_size=4, debug_checks=debug_checks
    )
    engine = LLMEngine(config)
    engine.add_request("r", [3, 4, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    return engine


def test_debug_checks_catch_a_ref_count_that_drifted():
    engine = _engine(debug_checks=True)
    engine.block_manager.blocks[engine.scheduler.running[0].block_table[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref count mismatch"):
        engine.step()


def test_the_scheduler_refuses_to_schedule_a_sequence_that_is_not_running():
    engine = _engine(debug_checks=False)
    engine.scheduler.running[0].status = engine.scheduler.running[0].status.WAITING
    with pytest.raises(AssertionError, match="not running"):
        engine.step()


@pytest.mark.usefixtures("processes")
def test_a_node_whose_invariant_fails_leaves_a_record_that_says_so(tmp_path):
    redis = RedisServer(tmp_path)
    opts = NodeOptions(
        role="prefill",
        host="127.0.0.1",
        port=0,
        kv_port=0,
        advertise_host="127.0.0.1",
        redis_url=redis.url,
        heartbeat_interval_s=0.1,
        heartbeat_ttl_s=5.0,
        stall_timeout_s=10.0,
        request_ttl_s=60.0,
        drain_timeout_s=1.0,
        node_id="prefill-broken",
        model_id="tiny",
    )
    runtime = NodeRuntime(opts, EventLog(opts.node_id))
    runtime.start(dataclasses.replace(PREFILL, node_id="prefill-broken"), None)

    def iterate() -> None:
        raise AssertionError("block 3 ref count mismatch")

    try:
        with pytest.raises(AssertionError):
            runtime.run(iterate, lambda: False, lambda: None)
        runtime.close()
        (record,) = list_nodes(redis.client)
        assert record.integrity_error == "block 3 ref count mismatch" and record.draining
        assert "failed: block 3 ref count mismatch" in render([record], now=record.heartbeat_time)
    finally:
        redis.stop()
