"""A rate limit for log lines that peers can cause at any rate (malformed frames): the first
``burst`` per window and key get through, the rest are counted and reported with the first line
of a later window. Used by the nodes' event log and the router's node client."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable


class Throttle:
    def __init__(self, burst: int, window_s: float) -> None:
        self._burst, self._window_s = burst, window_s
        self._windows: dict[Hashable, list] = {}  # key -> [window start, let through, left out]
        self._lock = threading.Lock()  # nodes log from their loop and shipper threads alike

    def admit(self, key: Hashable = None) -> tuple[bool, int]:
        """(whether this event gets its line, how many of this key were left out before it and
        not yet reported: nonzero only on the first event of a new window)."""
        now = time.monotonic()
        with self._lock:
            window = self._windows.get(key)
            left_out = 0
            if window is None or now - window[0] >= self._window_s:
                left_out = window[2] if window is not None else 0
                window = self._windows[key] = [now, 0, 0]
            if window[1] >= self._burst:
                window[2] += 1
                return False, 0
            window[1] += 1
            return True, left_out
