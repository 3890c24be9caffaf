"""Busy is not dead: a node whose engine is inside a long step stays live (its layers stamp
progress and answer status queries), and a node whose engine makes no progress does not."""

from __future__ import annotations

import threading
import time

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.node.log import EventLog
from pdserve.node.options import NodeOptions
from pdserve.node.runtime import NodeRuntime
from pdserve.protocol.channel import PeerChannel
from pdserve.protocol.messages import NodeStatus, StatusQuery, decode_frames
from tests.test_status import PREFILL
from tests.tiny_models import make_tiny_model

STALL_S = 0.3  # the node's stall timeout in these tests
LAYER_S = 0.1  # each decoder layer's extra time: a step of the deep tiny model's 8 outlasts 2 STALL_S


def _runtime(node_id: str) -> NodeRuntime:
    opts = NodeOptions(
        role="prefill",
        host="127.0.0.1",
        port=0,
        kv_port=0,
        advertise_host="127.0.0.1",
        redis_url=None,
        heartbeat_interval_s=0.05,
        heartbeat_ttl_s=1.0,
        stall_timeout_s=STALL_S,
        request_ttl_s=60.0,
        drain_timeout_s=1.0,
        node_id=node_id,
        model_id="tiny",
    )
    runtime = NodeRuntime(opts, EventLog(node_id))
    runtime.start(PREFILL, None)
    return runtime


def _slow_engine(runtime: NodeRuntime) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(model=str(make_tiny_model("llama-deep")), num_kv_blocks=16, block_size=4),
        on_layer=runtime.in_step,
    )
    for layer in engine.runner.model.model.layers:  # a slow machine: every layer takes LAYER_S
        layer.register_forward_pre_hook(lambda *_: time.sleep(LAYER_S))
    engine.add_request("r", [3, 4, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1))
    return engine


def test_a_node_in_a_step_longer_than_its_stall_timeout_stays_live_and_answers_status():
    runtime = _runtime("prefill-busy")
    engine = _slow_engine(runtime)
    assert engine.model_config.num_layers * LAYER_S > 2 * STALL_S
    peer = PeerChannel(runtime.control.address, decoder=decode_frames)
    ttls: list[float | None] = []
    answers: list[float] = []
    done = threading.Event()

    def watch() -> None:  # the heartbeat's view and a static router's, while the step runs
        nonce = 0
        while not done.is_set():
            ttls.append(runtime.beat_ttl_s(time.monotonic()))
            nonce += 1
            peer.send(StatusQuery(nonce=nonce))
            reply = peer.recv(timeout_s=STALL_S)
            if reply is not None and isinstance(reply.msg, NodeStatus) and reply.msg.nonce == nonce:
                answers.append(time.monotonic())

    watcher = threading.Thread(target=watch)
    try:
        runtime.in_step()  # the loop's last round, right before the step (the engine took a while to build)
        start = time.monotonic()
        watcher.start()
        time.sleep(0.05)
        (out,) = engine.step().outputs  # one step: every layer of the forward pass, on this thread
        seconds = time.monotonic() - start
        done.set()
        watcher.join(5)
        assert out.finished and seconds > 2 * STALL_S
        assert ttls and all(ttl is not None and ttl > 0 for ttl in ttls), ttls
        assert len(answers) >= 3 and max(b - a for a, b in zip(answers, answers[1:], strict=False)) < STALL_S
    finally:
        done.set()
        peer.close()
        runtime.close()


def test_a_node_whose_engine_makes_no_progress_expires_after_its_stall_timeout():
    runtime = _runtime("prefill-stuck")
    try:
        runtime.in_step()
        now = time.monotonic()
        assert runtime.beat_ttl_s(now) is not None
        assert runtime.beat_ttl_s(now + STALL_S + 0.01) is None  # no layer, no loop round since
        peer = PeerChannel(runtime.control.address, decoder=decode_frames)
        peer.send(StatusQuery(nonce=1))
        assert peer.recv(timeout_s=0.3) is None  # nothing answers while the engine does not move
        runtime.in_step()  # it moves again: the status goes out
        for _ in range(50):
            time.sleep(0.06)
            runtime.in_step()
            reply = peer.recv(timeout_s=0.0)
            if reply is not None:
                break
        assert reply is not None and reply.msg.nonce == 1
        peer.close()
    finally:
        runtime.close()
