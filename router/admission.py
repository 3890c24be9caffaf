"""Admission control: a bound on sub-requests in flight per stage; beyond it, 429 at once. And a
429 for a request whose first token is predicted to come too late (``shed_late_first_token``).

The router itself never queues: a request is either admitted (and the nodes queue it) or shed
with ``Retry-After``, so router memory stays bounded under any load. Prefill slots count
sub-requests in their prefill stage (until the first token); decode slots count all of them.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from pdserve.router.errors import APIError


class Stage(enum.StrEnum):
    """The two stages a sub-request holds a slot for (not node roles: a decode node's local
    prefill holds a prefill slot too)."""

    PREFILL = "prefill"  # until the first token
    DECODE = "decode"  # until the last


@dataclasses.dataclass(slots=True)
class Admission:
    max_inflight: dict[Stage, int]  # limit per stage
    retry_after_s: int = 1  # what shed clients are told
    num_inflight: dict[Stage, int] = dataclasses.field(default_factory=lambda: {r: 0 for r in Stage})
    num_rejected: dict[Stage, int] = dataclasses.field(default_factory=lambda: {r: 0 for r in Stage})

    def can_admit(self, role: Stage, num: int = 1) -> bool:
        return self.num_inflight[role] + num <= self.max_inflight[role]

    def admit(self, role: Stage, num: int = 1) -> None:
        """Take ``num`` slots of ``role`` or raise a 429 (taking none)."""
        if not self.can_admit(role, num):
            self.num_rejected[role] += 1
            raise APIError(
                429,
                f"the router has {self.num_inflight[role]} {role} requests in flight (limit "
                f"{self.max_inflight[role]}); retry later",
                None,
                "overloaded",
                self.retry_after_s,
            )
        self.num_inflight[role] += num

    def release(self, role: Stage, num: int = 1) -> None:
        assert self.num_inflight[role] >= num, f"releasing {num} {role} slots, {self.num_inflight[role]} held"
        self.num_inflight[role] -= num


class Ticket:
    """Slots one sub-request holds; each role is released once, whichever path ends it."""

    def __init__(self, admission: Admission, roles: tuple[Stage, ...]) -> None:
        self._admission = admission
        self._held = set(roles)  # taken by the caller through admit()

    def release(self, role: Stage) -> None:
        if role in self._held:
            self._held.discard(role)
            self._admission.release(role)

    def release_all(self) -> None:
        for role in list(self._held):
            self.release(role)


def shed_late_first_token(
    predicted_s: float | None, slo_s: float | None, timeout_s: float, shed_counter
) -> None:
    """429 for a new sample whose first token is predicted to come too late: after the TTFT SLO
    when there is one, else after ``timeout_s`` (the router's chunk timeout, past which it would
    abort the sample and retry it: a retry storm on a cluster that is already behind). Shed at
    once it costs the cluster nothing, where admitted it would take prefill time from requests
    that can still make it, and miss anyway. Retry-After: the seconds by which it would miss.
    ``predicted_s`` None: admitted; infinite (no speed measured, a queue ahead): shed under an
    SLO only (RoutingPolicy.predicted_ttft_s)."""
    limit_s, reason = (slo_s, "ttft_slo") if slo_s is not None else (timeout_s, "queue_timeout")
    if predicted_s is None or predicted_s <= limit_s or (slo_s is None and math.isinf(predicted_s)):
        return
    shed_counter.labels(reason=reason).inc()
    when = (
        "after prompts whose speed no node has measured yet"
        if math.isinf(predicted_s)
        else f"in about {predicted_s:.1f} s"
    )
    beyond = (
        f"beyond the {slo_s:g} s TTFT SLO"
        if slo_s is not None
        else f"after the router would give up waiting for it ({timeout_s:g} s, --chunk-timeout-s)"
    )
    raise APIError(
        429,
        f"the cluster is past its capacity: this prompt's first token would come {when}, {beyond}; "
        "retry later",
        None,
        "overloaded",
        1 if math.isinf(predicted_s) else max(1, math.ceil(predicted_s - limit_s)),
    )
