"""Structured logs: one JSON object per line on stderr, one line per event."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

from pdserve.protocol.throttle import Throttle

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
        self._throttle = Throttle(throttle_burst, throttle_window_s)

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
        admitted, left_out = self._throttle.admit((event, fields.get("port")))
        if not admitted:
            return
        if left_out:
            fields["left_out_before"] = left_out
        self(event, request_id, **fields)


# The loggers of pdserve's own modules (pdserve.engine.machine.cpu_share, pdserve.kernels.cpu_ext, ...). Their INFO records
# (a torch thread given up under load, a kernel built, a prefault turned off) matter in a node's
# log, and with no logging configured Python would print only warnings, as bare text.
OWN_LOGGERS = ("pdserve.engine", "pdserve.kernels")


class ForwardedLogs(logging.Handler):
    """Python logging records, as ``log`` events of the node's EventLog."""

    def __init__(self, log: EventLog) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log("log", level=record.levelname.lower(), logger=record.name, message=record.getMessage())
        except Exception:  # a record that cannot be formatted must not stop the node
            self.handleError(record)


def forward_own_logs(log: EventLog) -> ForwardedLogs:
    """Send the INFO and higher records of OWN_LOGGERS to ``log``; the handler, to remove later."""
    handler = ForwardedLogs(log)
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return handler
