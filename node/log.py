"""Structured logs: one JSON object per line on stderr, one line per event."""

from __future__ import annotations

import json
import sys
import threading
import time


class EventLog:
    def __init__(self, node_id: str, stream=None) -> None:
        self.node_id = node_id
        self.stream = stream or sys.stderr
        self._lock = threading.Lock()  # the node loop and shipper threads log alike: whole lines

    def __call__(self, event: str, request_id: str | None = None, **fields) -> None:
        record = {"ts": round(time.time(), 6), "node": self.node_id, "event": event}
        if request_id is not None:
            record["request_id"] = request_id
        record.update(fields)
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()
