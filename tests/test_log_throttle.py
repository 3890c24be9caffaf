"""Floods of peer-caused log lines (bad frames) are throttled: on the nodes' structured log and
on the router's."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time

from pdserve.node.log import EventLog
from pdserve.protocol.messages import ProtocolError
from pdserve.router import node_client


def _records(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_flood_of_bad_frames_costs_a_burst_of_lines_and_then_a_count():
    stream = io.StringIO()
    log = EventLog("node-0", stream, throttle_burst=5, throttle_window_s=0.2)
    for i in range(1000):
        log.throttled("bad_message", error=f"frame {i}")
    log.throttled("bad_message", port="kv", error="a kv frame")  # another port has its own budget
    log("request_added", "r1")  # ordinary events are never held back
    records = _records(stream)
    assert [r["error"] for r in records if r["event"] == "bad_message" and "port" not in r] == [
        f"frame {i}" for i in range(5)
    ]
    assert [r.get("port") for r in records if r.get("port")] == ["kv"]
    assert records[-1]["event"] == "request_added"
    time.sleep(0.25)
    log.throttled("bad_message", error="after the window")
    last = _records(stream)[-1]
    assert last["error"] == "after the window" and last["left_out_before"] == 995


def test_the_router_logs_a_burst_of_malformed_node_messages_and_then_a_count(caplog, monkeypatch):
    monkeypatch.setattr(node_client, "_BAD_LOG_WINDOW_S", 0.2)
    client = node_client.NodeClient()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.router.node_client"):
            for i in range(500):
                client._log_malformed(ProtocolError(f"frame {i}"))
            time.sleep(0.25)
            client._log_malformed(ProtocolError("after the window"))
    finally:
        asyncio.run(client.close())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:20] == [f"dropped a malformed node message: frame {i}" for i in range(20)]
    assert lines[20:] == [
        "left out 480 more malformed node messages",
        "dropped a malformed node message: after the window",
    ]


def test_a_nodes_own_module_logs_reach_its_event_log_from_info_up():
    from pdserve.node.log import OWN_LOGGERS, forward_own_logs

    stream = io.StringIO()
    handler = forward_own_logs(EventLog("node-1", stream))
    try:
        logging.getLogger("pdserve.engine.machine.cpu_share").info(
            "engine: %d torch threads (other processes took %.1f)", 1, 0.9
        )
        logging.getLogger("pdserve.kernels.cpu_ext").warning("CPU paged attention: no C++ compiler")
        logging.getLogger("pdserve.engine.machine.cpu_share").debug("not this")
        logging.getLogger("httpx").warning("nor another package's")
    finally:
        for name in OWN_LOGGERS:
            logging.getLogger(name).removeHandler(handler)
    records = [{k: v for k, v in r.items() if k != "ts"} for r in _records(stream)]
    assert records == [
        {
            "node": "node-1",
            "event": "log",
            "level": "info",
            "logger": "pdserve.engine.machine.cpu_share",
            "message": "engine: 1 torch threads (other processes took 0.9)",
        },
        {
            "node": "node-1",
            "event": "log",
            "level": "warning",
            "logger": "pdserve.kernels.cpu_ext",
            "message": "CPU paged attention: no C++ compiler",
        },
    ]
