"""A discrete-event model of a pdserve cluster: where a workload's requests wait, and for how long.

    arrival ─► route: the decode node with the fewest outstanding KV blocks, and
               ├─ prompt >= disagg_threshold, a plain decode node and a prefill node exists, and
               │  the prompt would not wait local_prefill_margin_s longer behind the shortest
               │  prefill queue than behind the decode node's own local prompts:
               │    prefill node queue (FIFO, steps of up to step_tokens: long prompts chunked,
               │    short ones sharing a step; prefill_s(step tokens))
               │      ─► first token ─► transfer_s(prompt KV) ─► the decode node's waiting queue
               └─ otherwise (short prompt, colocated node, no prefill node, or the prefill pool
                    backed up): the decode node's waiting queue, prefilled there in chunks beside
                    the running batch (first token at the end of its last chunk)
    decode node: one step at a time of up to step_tokens: every running request that decodes gains
                 a token, local prompts take chunks of what is left, waiting requests join up to
                 max_num_seqs; step time = decode_step_s(decoding, their context) + prefill_s(chunk
                 tokens). So a decode shares its steps with other prompts' chunks, as on a real node.

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

from pdserve.bench_serve.metrics import Slo
from pdserve.engine.core.step_budget import TPOT_SLO_STEP_SHARE  # torch-free
from pdserve.planner.profile import Profile
from pdserve.router.config import LOCAL_PREFILL_MARGIN_S  # a plain dataclass module: no torch
from pdserve.router.policy import place  # torch-free too


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
    decode_node: str  # e.g. "decode-0", "colocated-1"; "" when shed
    prefill_node: str | None  # None: prefilled on its decode node
    decode_wait_s: float  # KV arrived (or, local: request arrived) -> its first step on the decode node

    @property
    def shed(self) -> bool:
        """Refused with 429 by the router's TTFT SLO (no token)."""
        return not self.token_times_s

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.request.arrival_s if self.token_times_s else None

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
    num_prefilled: int = 0  # prompt tokens computed (on whichever node prefills it)
    shed: bool = False  # refused by the router

    @property
    def num_prompt_left(self) -> int:
        return self.request.prompt_len - self.num_prefilled

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
    """FIFO prompts, computed in steps of at most ``step_tokens``: a long prompt is chunked over
    several steps, and short ones share a step (the engine's chunked prefill and step budget)."""

    def __init__(
        self, name: str, profile: Profile, clock: _Clock, on_first_token: Callable[[_Live], None]
    ) -> None:
        self.name, self.profile, self.clock, self.on_first_token = name, profile, clock, on_first_token
        self.step_tokens = profile.step_tokens
        self.queue: collections.deque[_Live] = collections.deque()
        self.num_queued_tokens = 0  # prompt tokens not yet computed (the router's key)
        self.busy = False

    def submit(self, live: _Live) -> None:
        live.prefill_node = self.name
        self.queue.append(live)
        self.num_queued_tokens += live.request.prompt_len
        self._start()

    def _start(self) -> None:
        if self.busy or not self.queue:
            return
        chunks, budget = [], self.step_tokens
        for live in self.queue:
            if budget <= 0 or len(chunks) == self.profile.max_num_seqs:
                break
            take = min(live.num_prompt_left, budget)
            chunks.append((live, take))
            budget -= take
        self.busy = True
        step_s = self.profile.prefill_s(self.step_tokens - budget)
        self.clock.at(self.clock.now + step_s, lambda: self._done(chunks))

    def _done(self, chunks: list[tuple[_Live, int]]) -> None:
        self.busy = False
        for live, take in chunks:
            live.num_prefilled += take
            self.num_queued_tokens -= take
            if live.num_prompt_left == 0:
                self.queue.remove(live)
                live.token_times.append(self.clock.now)
                self.on_first_token(live)
        self._start()


class _DecodeNode:
    """Continuous batching as the engine's scheduler does it: each step, every decoding request
    gains a token and local prompts get chunks of what the step budget leaves; prompts whose KV
    came from a prefill node join without budget."""

    def __init__(
        self,
        name: str,
        colocated: bool,
        profile: Profile,
        clock: _Clock,
        on_finished: Callable[[_Live], None],
        decode_step_s: float | None = None,  # the target of steps that carry decodes (None: the other's)
    ) -> None:
        self.name, self.colocated, self.profile, self.clock, self.on_finished = (
            name,
            colocated,
            profile,
            clock,
            on_finished,
        )
        self.step_tokens = profile.step_tokens
        self.decode_step_s = decode_step_s
        # what the node reports: a running decode's time per token while prompts prefill beside it
        self.step_target_s = min(profile.step_target_s, decode_step_s or math.inf)
        self.waiting: collections.deque[_Live] = collections.deque()  # KV arrived, or to prefill here
        self.running: list[_Live] = []  # decoding, or prefilling here in chunks
        self.num_outstanding_blocks = 0  # blocks of requests routed here and not finished (the router's key)
        self.busy = False

    @property
    def num_queued_tokens(self) -> int:
        """Prompt tokens still to prefill here, running or waiting (as nodes report them)."""
        return sum(live.num_prompt_left for live in (*self.running, *self.waiting) if live.local)

    def submit(self, live: _Live) -> None:
        """A request to prefill here, or one whose KV just arrived."""
        live.ready_at = self.clock.now
        self.waiting.append(live)
        self._start()

    def _start(self) -> None:
        if self.busy:
            return
        decoding = [live for live in self.running if not live.num_prompt_left]
        budget = self.step_tokens - len(decoding)  # a decode row costs one token of the budget
        # chunks beside decodes keep to their target (only prompt chunks need the budget)
        prompts = any(live.num_prompt_left for live in self.running) or any(
            live.local for live in self.waiting
        )
        if prompts and decoding and self.decode_step_s is not None:
            decode_s = self.profile.decode(len(decoding), sum(live.num_context for live in decoding))
            floor = self.profile.min_step_tokens - len(decoding)
            budget = min(
                budget, max(floor, self.profile.prefill_tokens_within(self.decode_step_s - decode_s))
            )
        chunks = []
        for live in self.running:
            if live.num_prompt_left and budget > 0:
                chunks.append((live, min(live.num_prompt_left, budget)))
                budget -= chunks[-1][1]
        budget = self._admit(decoding, chunks, budget)
        if not decoding and not chunks:
            return
        step_s = self.profile.decode(
            len(decoding), sum(live.num_context for live in decoding)
        ) + self.profile.prefill_s(sum(take for _, take in chunks))
        self.busy = True
        self.clock.at(self.clock.now + step_s, lambda: self._done(decoding, chunks))

    def _admit(self, decoding: list[_Live], chunks: list[tuple[_Live, int]], budget: int) -> int:
        """Waiting requests into the running batch, in arrival order: KV-ready ones decode at
        once (no budget); a local prompt takes a chunk of the budget left, and once one waits for
        budget the local prompts behind it wait too, while KV-ready ones pass them."""
        kept: collections.deque[_Live] = collections.deque()
        prompts_wait = False
        while self.waiting:
            live = self.waiting.popleft()
            if len(self.running) >= self.profile.max_num_seqs or (
                live.local and (prompts_wait or budget <= 0)
            ):
                prompts_wait = prompts_wait or live.local
                kept.append(live)
                continue
            live.decode_wait_s = self.clock.now - live.ready_at
            self.running.append(live)
            if live.local:
                chunks.append((live, min(live.num_prompt_left, budget)))
                budget -= chunks[-1][1]
            else:
                live.num_context = live.request.prompt_len + 1  # the prompt and the first token
                decoding.append(live)
        self.waiting = kept
        return budget

    def _done(self, decoding: list[_Live], chunks: list[tuple[_Live, int]]) -> None:
        self.busy = False
        for live in decoding:
            live.token_times.append(self.clock.now)
            live.num_context += 1
        for live, take in chunks:
            live.num_prefilled += take
            if not live.num_prompt_left:  # its last chunk: the first token
                live.token_times.append(self.clock.now)
                live.num_context = live.request.prompt_len + 1
        for live in [live for live in self.running if live.num_left == 0]:
            self.running.remove(live)
            self.finish(live)
        self._start()

    def finish(self, live: _Live) -> None:
        self.num_outstanding_blocks -= live.num_blocks
        self.on_finished(live)


def simulate(
    profile: Profile, cluster: Cluster, requests: Sequence[SimRequest], slo_flags: Slo | None = None
) -> list[SimOutcome]:
    """Every request's token times, in request order. ``slo_flags``: the SLO targets the cluster
    runs with (`pdserve up --ttft-slo-s --tpot-slo-s`): the router sheds a request whose first
    token it predicts past the TTFT target (its outcome has no tokens) and lets a decode node with
    requests running prefill locally only within the TPOT target, and every node keeps the steps
    that carry decodes within ``TPOT_SLO_STEP_SHARE`` of it."""
    clock = _Clock()
    finished: dict[int, _Live] = {}
    decode_step_s = None if slo_flags is None else TPOT_SLO_STEP_SHARE * slo_flags.tpot_s

    def on_finished(live: _Live) -> None:
        finished[live.index] = live

    def decode_node(name: str, colocated: bool) -> _DecodeNode:
        return _DecodeNode(name, colocated, profile, clock, on_finished, decode_step_s)

    decoders = [decode_node(f"decode-{i}", False) for i in range(cluster.num_decode)]
    decoders += [decode_node(f"colocated-{i}", True) for i in range(cluster.num_colocated)]
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
    # the speed nodes report and the router turns prompt queues into seconds by
    tokens_per_s = profile.step_tokens / profile.prefill_s(profile.step_tokens)

    def local_fits(node: _DecodeNode) -> bool:  # RoutingPolicy.local_prefill_fits
        return not node.running or (slo_flags is not None and node.step_target_s <= slo_flags.tpot_s)

    def choose_decode() -> _DecodeNode:  # RoutingPolicy._choose_decode, without a prefix cache
        if all(node.colocated for node in decoders):
            return min(decoders, key=lambda n: (n.num_queued_tokens, n.num_outstanding_blocks, n.name))
        return min(decoders, key=lambda n: (n.num_outstanding_blocks, len(n.running), n.name))

    def arrive(live: _Live) -> None:
        node = choose_decode()
        n = live.request.prompt_len

        def backed_up(prefill: _PrefillNode) -> bool:
            wait_longer_s = (prefill.num_queued_tokens - node.num_queued_tokens) / tokens_per_s
            return 0 <= cluster.local_prefill_margin_s < wait_longer_s and local_fits(node)

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
        queued = (node if prefill is None else prefill).num_queued_tokens + n
        if slo_flags is not None and queued / tokens_per_s > slo_flags.ttft_s:  # shed_late_first_token
            live.shed = True
            finished[live.index] = live
            return
        node.num_outstanding_blocks += live.num_blocks
        live.decode_node = node.name
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
