"""Structured logs: one JSON object per line on stderr, one line per event."""

from __future__ import annotations

import json
import sys
import threading
import time

# Events a peer can cause at any rate (bad frames) are logged at most BURST times per window;
# the first line of a later window says how many were left out.
THROTTLE_BURST = 20
THROTTLE_WINDOW_S = 10.0


class EventLog:
    def __init__(
        self,
        node_id: str,
        stream=None,
        throttle_burst: int = THROTTLE_BURST,
        throttle_window_s: float = THROTTLE_WINDOW_S,
    ) -> None:
        self.node_id = node_id
        self.stream = stream or sys.stderr
        self._lock = threading.Lock()  # the node loop and shipper threads log alike: whole lines
        self._burst, self._window_s = throttle_burst, throttle_window_s
        # (event, port) -> [window start, lines written, lines left out]
        self._windows: dict[tuple[str, object], list] = {}

    def __call__(self, event: str, request_id: str | None = None, **fields) -> None:
        record = {"ts": round(time.time(), 6), "node": self.node_id, "event": event}
        if request_id is not None:
            record["request_id"] = request_id
        record.update(fields)
        line = json.dumps(record, default=str) + "\n"
        with self._lock:
            self.stream.write(line)
            self.stream.flush()

    def throttled(self, event: str, request_id: str | None = None, **fields) -> None:
        """As a call, for events that outside input can cause at any rate: a flood of them
        costs a few lines per window and port, not one line each."""
        now, key = time.monotonic(), (event, fields.get("port"))
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window[0] >= self._window_s:
                left_out = window[2] if window is not None else 0
                window = self._windows[key] = [now, 0, 0]
                if left_out:
                    fields["left_out_before"] = left_out
            if window[1] >= self._burst:
                window[2] += 1
                return
            window[1] += 1
        self(event, request_id, **fields)
