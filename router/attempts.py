"""What one attempt of a sample ends in (router.generation's retry loop), and what the attempts
of a sample carry from one to the next."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pdserve.router.errors import APIError
from pdserve.router.route_trail import RouteTrail

if TYPE_CHECKING:
    from pdserve.router.spans import SampleTrace


@dataclasses.dataclass(frozen=True, slots=True)
class Done:
    """The attempt relayed the sample's last chunk."""


@dataclasses.dataclass(frozen=True, slots=True)
class Retry:
    """Failed before its first token: another pair, without ``node_id``."""

    node_id: str
    reason: str
    blame: bool = True  # False: the node left the registry; should its record come back, it may serve


@dataclasses.dataclass(frozen=True, slots=True)
class Migrate:
    """The decode node died or stalled after tokens: the sample resumes on another one."""

    node_id: str
    error: APIError  # what the client gets if no node can take it


@dataclasses.dataclass(frozen=True, slots=True)
class Replay:
    """After tokens, with migration off, a non-streamed sample starts over elsewhere. run_sample
    yields it to its caller: what came so far is void."""

    reason: str


Outcome = Done | Retry | Migrate | Replay


@dataclasses.dataclass(slots=True)
class Progress:
    """What a sample's attempts carry from one to the next."""

    relayed: list[int] = dataclasses.field(default_factory=list)  # output tokens the caller has
    excluded: set[str] = dataclasses.field(default_factory=set)  # nodes the next routes avoid
    num_retries: int = 0
    num_migrations: int = 0
    last_error: str = "no attempt made"
    migrating: Migrate | None = None  # why the sample is migrating
    replayable: bool = False  # after tokens and without migration, it may start over (not streamed)
    trail: RouteTrail = dataclasses.field(default_factory=RouteTrail)  # where its attempts ran
    trace: SampleTrace | None = None  # its spans (router/spans.py); None: nobody traces it
