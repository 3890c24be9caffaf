"""``POST /admin/autoscale``: an autoscaler (``pdserve up --autoscale``) reports each decision it
takes; ``GET /admin/autoscale`` lists the latest ones, and /metrics counts them by kind and shows
the pool sizes the last one aimed at, beside the router's own series, for one scrape to plot.
"""

from __future__ import annotations

import collections
import time
from typing import Literal

import pydantic
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.protocol.registry import Role

KINDS = ("scale", "idle", "cooldown", "confirming", "best", "no_gain", "missing_slo")  # planner.scaling.Kind
RoleName = Literal["prefill", "decode", "colocated"]  # protocol.registry.Role's values
FamilyName = Literal["disaggregated", "colocated"]  # planner.correction.FAMILIES
MAX_KEPT = 200  # decisions GET /admin/autoscale lists


class DecisionBody(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True, extra="forbid")

    kind: str = pydantic.Field(pattern="^(" + "|".join(KINDS) + ")$")
    current: str = pydantic.Field(max_length=64)  # the shape, e.g. "1P+1D"
    target: str = pydantic.Field(max_length=64)
    target_nodes: dict[RoleName, pydantic.NonNegativeInt]
    reason: str = pydantic.Field(max_length=2000)
    predicted_slo_fraction: dict[str, float] = pydantic.Field(default_factory=dict, max_length=64)
    prefill_scale: dict[FamilyName, pydantic.PositiveFloat] = pydantic.Field(default_factory=dict)


class ScalingLog:
    """The decisions an autoscaler reported, and their series on the router's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._kept: collections.deque[dict] = collections.deque(maxlen=MAX_KEPT)
        self._decisions = Counter(
            "pdserve_autoscale_decisions_total",
            "Decisions an autoscaler reported, by kind: scale (the pools change) or why they hold.",
            ["kind"],
            registry=registry,
        )
        for kind in KINDS:
            self._decisions.labels(kind=kind)
        self._target = Gauge(
            "pdserve_autoscale_target_nodes",
            "Nodes per role the autoscaler's last decision aims at (absent until one is reported).",
            ["role"],
            registry=registry,
        )

        self._prefill_scale = Gauge(
            "pdserve_autoscale_prefill_scale",
            "The autoscaler's model correction: measured prefill time over the profile's, by shape "
            "family (disaggregated: shapes with prefill nodes; colocated), from its windows' TTFT.",
            ["family"],
            registry=registry,
        )

    def record(self, body: DecisionBody) -> dict:
        entry = {"time": round(time.time(), 3), **body.model_dump(mode="json")}
        self._kept.append(entry)
        self._decisions.labels(kind=body.kind).inc()
        for role in Role:
            self._target.labels(role=role.value).set(body.target_nodes.get(role.value, 0))
        for name, scale in body.prefill_scale.items():
            self._prefill_scale.labels(family=name).set(scale)
        return entry

    def body(self) -> dict:
        return {"decisions": list(self._kept)}
