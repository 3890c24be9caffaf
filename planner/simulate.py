"""A discrete-event model of a pdserve cluster: where a workload's requests wait, and for how long.

    arrival ─► route: the decode node with the fewest outstanding KV blocks, and
               ├─ prompt >= disagg_threshold, a plain decode node and a prefill node exists, and
               │  the prompt would not wait local_prefill_margin_s longer behind the shortest
               │  prefill queue than behind the decode node's own local prompts:
               │    prefill node queue (FIFO, batches up to the token budget, prefill_s(batch tokens))
               │      ─► first token ─► transfer_s(prompt KV) ─► the decode node's waiting queue
               └─ otherwise (short prompt, colocated node, no prefill node, or the prefill pool
                    backed up): the decode node's waiting queue, prefilled there in a step beside
                    the running batch (first token at its end)
    decode node: one step at a time: admit waiting requests up to max_num_seqs (local prefills up to
                 the token budget), step time = decode_step_s(running, their context) + prefill_s(local
                 prompt tokens); every running request gains one token at the step's end.

What it leaves out: prefix caching, the router's and HTTP's own latency, and nodes sharing cores
(each node runs at the profile's speed). As in pdserve, the prefill node reports the first token
before the KV transfer starts, so the transfer delays the second token, not the first.
Torch-free.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from planner.profile import Profile
from router.config import LOCAL_PREFILL_MARGIN_S  # a plain dataclass module: no torch
from router.policy import place  # torch-free too


@dataclasses.dataclass(frozen=True, slots=True)
class Cluster:
    num_prefill: int  # prefill nodes
    num_decode: int  # decode nodes
    num_colocated: int = 0  # nodes that prefill and decode all they take
    disagg_threshold: int = 64  # prompts shorter than this prefill on their decode node
    block_size: int = 16  # KV block size, for the router's outstanding-block count
    local_prefill_margin_s: float = LOCAL_PREFILL_MARGIN_S  # as the router's; < 0: off

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_colocated, self.disagg_threshold) < 0:
            raise ValueError("node counts and the threshold must be >= 0")
        if self.num_decode + self.num_colocated < 1:
            raise ValueError("a cluster needs a decode or a colocated node")

    @property
    def num_nodes(self) -> int:
        return self.num_prefill + self.num_decode + self.num_colocated

    @property
    def label(self) -> str:
        if self.num_colocated and not (self.num_prefill or self.num_decode):
            return f"{self.num_colocated} colocated"
        label = f"{self.num_prefill}P+{self.num_decode}D"
        return label + (f"+{self.num_colocated}C" if self.num_colocated else "")


@dataclasses.dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float  # seconds after the start
    prompt_len: int  # uncached prompt tokens
    output_len: int  # tokens generated (ignore_eos)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1 or self.arrival_s < 0:
            raise ValueError(f"a request needs >= 1 prompt and output token and arrival >= 0, got {self}")


@dataclasses.dataclass(frozen=True, slots=True)
class SimOutcome:
    request: SimRequest
    token_times_s: tuple[float, ...]  # when each output token came out (seconds after the start)
    decode_node: str  # e.g. "decode-0", "colocated-1"
    prefill_node: str | None  # None: prefilled on its decode node
    decode_wait_s: float  # KV arrived (or, local: request arrived) -> its first step on the decode node

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times_s)
        return None if n < 2 else (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1)


@dataclasses.dataclass(eq=False, slots=True)
class _Live:
    """A request in flight: what the model tracks while it moves through the nodes."""

    index: int
    request: SimRequest
    local: bool  # prefilled on its decode node
    num_blocks: int  # blocks the router counts against its decode node
    token_times: list[float] = dataclasses.field(default_factory=list)
    num_context: int = 0  # tokens whose KV the decode node holds
    ready_at: float = 0.0  # when it joined the decode node's waiting queue
    decode_wait_s: float = 0.0
    decode_node: str = ""
    prefill_node: str | None = None

    @property
    def num_left(self) -> int:
        return self.request.output_len - len(self.token_times)


class _Clock:
    """The event queue: callbacks run in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time_s: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time_s, next(self._order), callback))

    def run(self) -> None:
        while self._events:
            self.now, _, callback = heapq.heappop(self._events)
            callback()


class _PrefillNode:
    def __init__(
        self, name: str, profile: Profile, clock: _Clock, on_first_token: Callable[[_Live], None]
    ) -> None:
        self.name, self.profile, self.clock, self.on_first_token = name, profile, clock, on_first_token
        self.queue: collections.deque[_Live] = collections.deque()
        self.num_queued_tokens = 0  # prompt tokens queued or being computed (the router's key)
        self.busy = False

    def submit(self, live: _Live) -> None:
        live.prefill_node = self.name
        self.queue.append(live)
        self.num_queued_tokens += live.request.prompt_len
        self._start()

    def _start(self) -> None:
        if self.busy or not self.queue:
            return
        batch = [self.queue.popleft()]
        num_tokens = batch[0].request.prompt_len
        while (
            self.queue
            and num_tokens + self.queue[0].request.prompt_len <= self.profile.max_num_batched_tokens
        ):
            batch.append(self.queue.popleft())
            num_tokens += batch[-1].request.prompt_len
        self.busy = True
        self.clock.at(self.clock.now + self.profile.prefill_s(num_tokens), lambda: self._done(batch))

    def _done(self, batch: list[_Live]) -> None:
        self.busy = False
        for live in batch:
            self.num_queued_tokens -= live.request.prompt_len
            live.token_times.append(self.clock.now)
            self.on_first_token(live)
        self._start()


class _DecodeNode:
    def __init__(
        self,
        name: str,
        colocated: bool,
        profile: Profile,
        clock: _Clock,
        on_finished: Callable[[_Live], None],
    ) -> None:
        self.name, self.colocated, self.profile, self.clock, self.on_finished = (
            name,
            colocated,
            profile,
            clock,
            on_finished,
        )
        self.waiting: collections.deque[_Live] = collections.deque()  # KV arrived, or to prefill here
        self.running: list[_Live] = []
        self.num_outstanding_blocks = 0  # blocks of requests routed here and not finished (the router's key)
        self.num_prefilling_tokens = 0  # local prompt tokens in the step under way
        self.busy = False

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens to prefill here, in the step under way or waiting (as nodes report them)."""
        return self.num_prefilling_tokens + sum(
            live.request.prompt_len for live in self.waiting if live.local
        )

    def submit(self, live: _Live) -> None:
        """A request to prefill here, or one whose KV just arrived."""
        live.ready_at = self.clock.now
        self.waiting.append(live)
        self._start()

    def _start(self) -> None:
        if self.busy:
            return
        prefills = self._admit()
        if not self.running and not prefills:
            return
        num_prefill_tokens = sum(live.request.prompt_len for live in prefills)
        self.num_prefilling_tokens = num_prefill_tokens
        step_s = self.profile.decode(
            len(self.running), sum(live.num_context for live in self.running)
        ) + self.profile.prefill_s(num_prefill_tokens)
        decoding = list(self.running)
        self.busy = True
        self.clock.at(self.clock.now + step_s, lambda: self._done(decoding, prefills))

    def _admit(self) -> list[_Live]:
        """Waiting requests that join this step, in arrival order: KV-ready ones into the running
        batch, local ones as this step's prefills (within the token budget)."""
        prefills: list[_Live] = []
        budget = self.profile.max_num_batched_tokens - len(self.running)
        while self.waiting and len(self.running) + len(prefills) < self.profile.max_num_seqs:
            live = self.waiting[0]
            if live.local and live.request.prompt_len > budget and (prefills or self.running):
                break
            self.waiting.popleft()
            live.decode_wait_s = self.clock.now - live.ready_at
            if live.local:
                prefills.append(live)
                budget -= live.request.prompt_len
            else:
                live.num_context = live.request.prompt_len + 1  # the prompt and the first token
                self.running.append(live)
        return prefills

    def _done(self, decoding: list[_Live], prefills: list[_Live]) -> None:
        self.busy = False
        self.num_prefilling_tokens = 0
        for live in decoding:
            live.token_times.append(self.clock.now)
            live.num_context += 1
        for live in prefills:
            live.token_times.append(self.clock.now)
            live.num_context = live.request.prompt_len + 1
            self.running.append(live)
        for live in [live for live in self.running if live.num_left == 0]:
            self.running.remove(live)
            self.finish(live)
        self._start()

    def finish(self, live: _Live) -> None:
        self.num_outstanding_blocks -= live.num_blocks
        self.on_finished(live)


def simulate(profile: Profile, cluster: Cluster, requests: Sequence[SimRequest]) -> list[SimOutcome]:
    """Every request's token times, in request order."""
    clock = _Clock()
    finished: dict[int, _Live] = {}

    def on_finished(live: _Live) -> None:
        finished[live.index] = live

    decoders = [
        _DecodeNode(f"decode-{i}", False, profile, clock, on_finished) for i in range(cluster.num_decode)
    ]
    decoders += [
        _DecodeNode(f"colocated-{i}", True, profile, clock, on_finished) for i in range(cluster.num_colocated)
    ]
    by_name = {node.name: node for node in decoders}

    def on_first_token(live: _Live) -> None:  # from a prefill node
        node = by_name[live.decode_node]
        if live.num_left == 0:
            node.finish(live)
        else:
            clock.at(clock.now + profile.transfer_s(live.request.prompt_len), lambda: node.submit(live))

    prefills = [
        _PrefillNode(f"prefill-{i}", profile, clock, on_first_token) for i in range(cluster.num_prefill)
    ]

    def arrive(live: _Live) -> None:
        node = min(decoders, key=lambda n: (n.num_outstanding_blocks, len(n.running), n.name))
        node.num_outstanding_blocks += live.num_blocks
        live.decode_node = node.name
        n = live.request.prompt_len

        def backed_up(prefill: _PrefillNode) -> bool:
            wait_longer_s = profile.prefill_s(prefill.num_queued_tokens + n) - profile.prefill_s(
                node.num_queued_tokens + n
            )
            return 0 <= cluster.local_prefill_margin_s < wait_longer_s

        prefill, _ = place(  # the router's own rule (the simulation knows no prefix cache)
            colocated=node.colocated,
            disaggregate=True,
            num_uncached_tokens=n,
            threshold=cluster.disagg_threshold,
            find_prefill=lambda: (
                min(prefills, key=lambda p: (p.num_queued_tokens, len(p.queue), p.name)) if prefills else None
            ),
            backed_up=backed_up,
        )
        live.local = prefill is None
        (node if prefill is None else prefill).submit(live)

    for index, request in enumerate(requests):
        num_blocks = math.ceil((request.prompt_len + request.output_len) / cluster.block_size)
        live = _Live(index, request, local=False, num_blocks=num_blocks)
        clock.at(request.arrival_s, lambda live=live: arrive(live))
    clock.run()
    assert len(finished) == len(requests), "every request finishes: nothing in the model waits forever"
    return [
        SimOutcome(
            live.request, tuple(live.token_times), live.decode_node, live.prefill_node, live.decode_wait_s
        )
        for live in (finished[i] for i in range(len(requests)))
    ]
