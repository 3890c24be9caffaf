"""Where each sample ran, told to the client and to /metrics: the silent-fallback problem of PD
clusters (a prompt quietly prefilled on its decode node, a prefill node that never takes work)
made visible per request.

A sample's **path** is where its prompt was computed, by the attempt that produced its first token:

    disaggregated   a prefill node computed the prompt and shipped its KV to the decode node
    local-prefill   the decode node prefilled the prompt itself, for a ``PathReason``
    colocated       a colocated node (it prefills and decodes everything it takes)

``RouteTrail`` records every attempt of one sample as ``router.generation`` makes it (the route
it sent, its first token, a migration to another decode node). ``headers`` turns the trails of a
request's samples into the ``x-pdserve-*`` response headers, one comma-separated entry per
sample; ``route_notice`` is the same facts as JSON, for the last event of a stream whose route
changed after its headers went out (a retry of another sample, a migration).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Sequence

from pdserve.protocol.registry import NodeInfo, Role
from pdserve.protocol.throttle import Throttle
from pdserve.router.policy import Placement, Route

log = logging.getLogger(__name__)
# One warning line a minute at most: a cluster that fell back does so for every request.
_IDLE_WARNING = Throttle(burst=1, window_s=60.0)


class Path(enum.StrEnum):
    DISAGGREGATED = "disaggregated"
    LOCAL_PREFILL = "local-prefill"
    COLOCATED = "colocated"


class PathReason(enum.StrEnum):
    """Why a prompt was prefilled on its decode node (local-prefill)."""

    SHORT_PROMPT = "short-prompt"  # fewer uncached tokens than --disagg-threshold
    PREFILL_BACKED_UP = "prefill-backed-up"  # the prefill pool's queue was longer by the margin
    NO_PREFILL_NODE = "no-prefill-node"  # no live prefill node could pair with the decode node
    PREFILL_RETRY = "prefill-retry"  # an attempt through a prefill node failed; the retry ran locally
    MIGRATED = "migrated"  # only a migrated sample's later attempts: never a first token's


_REASONS = {
    Placement.SHORT: PathReason.SHORT_PROMPT,
    Placement.BACKED_UP: PathReason.PREFILL_BACKED_UP,
    Placement.NO_PREFILL_NODE: PathReason.NO_PREFILL_NODE,
    Placement.RESUMED: PathReason.MIGRATED,
}
# Every (path, reason) a first token can have: /metrics shows each from 0.
PATH_LABELS: tuple[tuple[Path, PathReason | None], ...] = (
    (Path.DISAGGREGATED, None),
    (Path.COLOCATED, None),
    *((Path.LOCAL_PREFILL, r) for r in PathReason if r is not PathReason.MIGRATED),
)


@dataclasses.dataclass(frozen=True, slots=True)
class Leg:
    """One attempt's route, as the client is told it."""

    path: Path
    reason: PathReason | None  # set for local-prefill only
    prefill_node: str | None  # disaggregated only
    decode_node: str


def leg_of(route: Route, after_prefill_failure: bool) -> Leg:
    """The leg ``route`` makes; ``after_prefill_failure``: an earlier attempt of the sample went
    through a prefill node and failed before its first token."""
    if route.prefill is not None:
        return Leg(Path.DISAGGREGATED, None, route.prefill.node_id, route.decode.node_id)
    if route.placement is Placement.COLOCATED:
        return Leg(Path.COLOCATED, None, None, route.decode.node_id)
    reason = _REASONS.get(route.placement, PathReason.NO_PREFILL_NODE)
    if after_prefill_failure and reason in (PathReason.NO_PREFILL_NODE, PathReason.PREFILL_BACKED_UP):
        reason = PathReason.PREFILL_RETRY
    return Leg(Path.LOCAL_PREFILL, reason, None, route.decode.node_id)


@dataclasses.dataclass(slots=True)
class RouteTrail:
    """One sample's attempts. ``served``: the leg that produced its first token (None before);
    ``current``: the latest attempt's leg (None before the first is sent)."""

    current: Leg | None = None
    served: Leg | None = None
    decode_nodes: list[str] = dataclasses.field(default_factory=list)  # that produced output, in order
    num_retries: int = 0  # attempts sent again before the first token
    num_migrations: int = 0  # resumptions on another decode node after tokens
    prefill_failed: bool = False  # an attempt through a prefill node failed before its first token

    def sent(self, route: Route, resumed: bool) -> None:
        """An attempt went out along ``route`` (``resumed``: a migration, after tokens)."""
        if self.current is not None and not resumed and self.served is None:
            self.num_retries += 1
            self.prefill_failed |= self.current.prefill_node is not None
        self.current = leg_of(route, self.prefill_failed)
        if resumed:
            self.num_migrations += 1

    def first_output(self) -> None:
        """The current attempt relayed its first token (of the sample, or after a migration)."""
        assert self.current is not None
        if self.served is None:
            self.served = self.current
        if not self.decode_nodes or self.decode_nodes[-1] != self.current.decode_node:
            self.decode_nodes.append(self.current.decode_node)

    def replayed(self) -> None:
        """With migration off, a non-streamed sample starts over: what it had is void."""
        self.served, self.decode_nodes = None, []

    def view(self) -> Leg | None:
        """The leg a client is told: the one that served, else the one under way."""
        return self.served or self.current

    def fields(self) -> dict[str, object]:
        """This sample's route as JSON (the final-event notice, the docs' shape)."""
        leg = self.view()
        return {
            "path": None if leg is None else str(leg.path),
            "reason": None if leg is None or leg.reason is None else str(leg.reason),
            "prefill_node": None if leg is None else leg.prefill_node,
            "decode_nodes": list(self.decode_nodes) or ([leg.decode_node] if leg else []),
            "retries": self.num_retries,
            "migrations": self.num_migrations,
        }


def headers(trails: Sequence[RouteTrail]) -> dict[str, str]:
    """The x-pdserve-* headers of a request: one entry per sample, comma-separated, "-" where a
    sample has none; the optional ones only when some sample has a value."""
    rows = [t.fields() for t in trails]

    def joined(key: str) -> str:
        return ", ".join("-" if not r[key] else str(r[key]) for r in rows)

    out = {"x-pdserve-path": joined("path")}
    for key, header in (("reason", "path-reason"), ("prefill_node", "prefill-node")):
        if any(r[key] for r in rows):
            out[f"x-pdserve-{header}"] = joined(key)
    out["x-pdserve-decode-node"] = ", ".join(">".join(r["decode_nodes"]) or "-" for r in rows)  # type: ignore[arg-type]
    for key in ("retries", "migrations"):
        if any(r[key] for r in rows):
            out[f"x-pdserve-{key}"] = ", ".join(str(r[key]) for r in rows)
    return out


def route_notice(trails: Sequence[RouteTrail]) -> list[dict[str, object]]:
    """Every sample's route as JSON: what a stream's last event carries when it changed after
    the headers were sent (``pdserve_route``)."""
    return [t.fields() for t in trails]


def warn_if_prefill_idle(route: Route, leg: Leg, num_prompt_tokens: int, nodes: Sequence[NodeInfo]) -> None:
    """A warning (at most one a minute) when a prompt long enough to disaggregate is prefilled on
    its decode node while some prefill node has nothing queued: the silent fallback operators miss."""
    if leg.path is not Path.LOCAL_PREFILL or leg.reason in (PathReason.SHORT_PROMPT, PathReason.MIGRATED):
        return
    idle = [
        n.node_id
        for n in nodes
        if n.role is Role.PREFILL and not n.draining and n.num_queued_prefill_tokens == 0
    ]
    if not idle:
        return
    admitted, left_out = _IDLE_WARNING.admit()
    if not admitted:
        return
    more = f" ({left_out} more since the last warning)" if left_out else ""
    log.warning(
        "prefill pool idle while prompts are prefilled locally: a %d-token prompt prefilled on decode "
        "node %s (%s) while prefill node(s) %s had nothing queued%s; see docs/operations.md, "
        "'Where requests ran'",
        num_prompt_tokens,
        route.decode.node_id,
        leg.reason,
        ", ".join(sorted(idle)),
        more,
    )
