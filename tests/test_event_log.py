"""The node's structured log: whole JSON lines, and floods of peer-caused events throttled."""

from __future__ import annotations

import io
import json
import time

from node.log import EventLog


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
