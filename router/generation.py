"""One sample (n == 1) through the cluster: pick a pair, send, relay its chunks, fail over.

    attempt k:  choose (P, D) ─► GenerateRequest to P (decode_addr = D.kv_addr) or to D alone
                ◄─ TokenChunk(is_first) from P, then TokenChunks from D until finish_reason

This is the router's one retry loop, with request ids ``{id}``, ``{id}.r1``, ``{id}.r2``...
Before an attempt's first token, a retryable RequestFailed, a timeout or a node leaving sends the
sample to another pair (the node to blame excluded; one that only left the registry may take it
again should its record come back), ``max_attempts`` tries in all. A sample under way that finds
no usable node waits up to ``reroute_wait_s`` for one before its 503. After tokens,
when the decode node dies or stalls, the sample *migrates* (up to ``max_migrations`` times): a
decode node elsewhere gets the prompt plus every token already relayed
(``GenerateRequest.output_token_ids``), recomputes their KV and goes on, so the client's stream
continues with no gap and no repeated token; positions, penalties and seeded draws (a function of
seed, sample and position) go on as if uninterrupted, so a greedy or seeded continuation equals
the undisturbed output. With migration off (``--no-migration``), a non-streamed sample is
replayed from scratch (the caller gets a ``Replay`` and drops what it had) and a streamed one
fails with an error event. Each attempt ends in a typed outcome (Done, Retry, Migrate, Replay)
or raises the APIError the client gets. Whenever an attempt ends without a finish_reason (error, stop string,
client gone) both its nodes get an AbortRequest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator

from pdserve.protocol import messages as pm
from pdserve.protocol.block_hash import cache_root_of
from pdserve.protocol.reasons import FailureCode
from pdserve.protocol.sampling_params import SamplingParams
from pdserve.protocol.tracing import Tracer
from pdserve.router.admission import Stage, Ticket, shed_late_first_token
from pdserve.router.attempts import Done, Migrate, Outcome, Progress, Replay, Retry
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.node_client import NodeClient, NodeUnavailable
from pdserve.router.policy import Route, RoutingPolicy
from pdserve.router.registry_client import NodeRegistry
from pdserve.router.route_trail import RouteTrail, warn_if_prefill_idle
from pdserve.router.spans import SampleTrace

log = logging.getLogger(__name__)
_LIVENESS_CHECK_S = 0.2  # how often a waiting sample checks that its nodes are still alive


@dataclasses.dataclass(slots=True)
class Backend:
    """Everything a sample needs from the router process."""

    config: RouterConfig
    nodes: NodeClient
    registry: NodeRegistry
    policy: RoutingPolicy
    metrics: RouterMetrics
    tracer: Tracer | None = None  # protocol/tracing.py; None: this router makes no span


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    request_id: str  # unique across the cluster; retries add ".r<k>"
    prompt_ids: tuple[int, ...]
    params: SamplingParams  # n == 1, max_tokens set; stop strings stay in the router
    arrival_time: float  # router wall clock when the HTTP request arrived
    adapter_rank: int | None = None  # params.adapter's rank: only nodes that hold it serve the sample


class _Retry(Exception):
    def __init__(self, node_id: str, reason: str, blame: bool = True) -> None:
        super().__init__(reason)
        self.node_id = node_id
        self.blame = blame  # excluded from the next attempts; not a node that only left the registry


def _node_error(failed: pm.RequestFailed, after_tokens: bool) -> APIError:
    if failed.code is FailureCode.BAD_REQUEST:
        return APIError(
            400, f"node {failed.node_id} rejected the request: {failed.message}", None, "bad_request"
        )
    status = 503 if failed.code.unavailable and not after_tokens else 502
    return APIError(
        status,
        f"node {failed.node_id} failed: {failed.code}: {failed.message}",
        None,
        failed.code,
        1 if status == 503 else None,
    )


def _choose(backend: Backend, sample: Sample, relayed: list[int], excluded: set[str]) -> Route | None:
    return backend.policy.choose(
        backend.registry.snapshot(),
        (*sample.prompt_ids, *relayed),
        (sample.params.max_tokens or 1) - len(relayed),
        frozenset(excluded),
        disaggregate=not relayed,  # a migrated sample resumes on a decode node alone
        cache_root=cache_root_of(sample.params.adapter, sample.params.cache_salt),
        adapter=None if sample.params.adapter is None else (sample.params.adapter, sample.adapter_rank or 1),
    )


async def _route(backend: Backend, sample: Sample, progress: Progress) -> Route:
    """The next attempt's pair; APIError when there is none. A sample already under way (its
    node failed or left) waits up to ``reroute_wait_s`` for one: a node whose record lapsed for a
    moment, or every record at once when a paused machine's wall clock steps and Redis expires
    them, is back within a heartbeat."""
    under_way = bool(progress.relayed or progress.num_retries or progress.migrating)
    deadline = time.monotonic() + (backend.config.reroute_wait_s if under_way else 0.0)
    waited = False
    while (route := _usable_route(backend, sample, progress)) is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if waited:
                backend.metrics.node_waits.labels(outcome="gave_up").inc()
            if progress.migrating is not None:
                raise progress.migrating.error
            raise APIError(503, f"no usable decode node ({progress.last_error})", None, "no_nodes", 1)
        waited = True
        await asyncio.sleep(min(remaining, backend.config.poll_interval_s))
    if waited:
        backend.metrics.node_waits.labels(outcome="found").inc()
    if not under_way:
        nodes = backend.registry.snapshot()
        predicted = backend.policy.predicted_ttft_s(route, len(sample.prompt_ids), nodes)
        config = backend.config
        shed_late_first_token(predicted, config.ttft_slo_s, config.chunk_timeout_s, backend.metrics.shed)
    return route


def _usable_route(backend: Backend, sample: Sample, progress: Progress) -> Route | None:
    route = _choose(backend, sample, progress.relayed, progress.excluded)
    if route is None and progress.migrating is not None:
        # No other node: the one that failed may serve its own migration if it still lives.
        progress.excluded.discard(progress.migrating.node_id)
        route = _choose(backend, sample, progress.relayed, progress.excluded)
    return route


async def run_sample(
    backend: Backend,
    sample: Sample,
    ticket: Ticket,
    replay_after_tokens: bool = False,
    trail: RouteTrail | None = None,
    trace: SampleTrace | None = None,
) -> AsyncGenerator[pm.TokenChunk | Replay, None]:
    """The sample's chunks, in order, the last with a finish_reason (or a Replay, then the chunks
    of the replay, when ``replay_after_tokens`` and migration is off); APIError on failure.
    ``trail``: where its attempts go is recorded there (router.route_trail); ``trace``: its spans."""
    progress = Progress(replayable=replay_after_tokens, trail=trail or RouteTrail(), trace=trace)
    for attempt in itertools.count():
        routing = time.time_ns()
        route = await _route(backend, sample, progress)
        request_id = sample.request_id if attempt == 0 else f"{sample.request_id}.r{attempt}"
        if progress.trace is not None:
            progress.trace.routed(route, request_id, routing, len(progress.relayed))
        outcome: list[Outcome] = []
        async for chunk in _attempt(backend, route, request_id, sample, ticket, progress, outcome):
            yield chunk
        (result,) = outcome
        if isinstance(result, Done):
            return
        if isinstance(result, Replay):
            progress.trail.replayed()
            yield result
        if not _count(backend, sample, progress, result, attempt):
            break
    raise APIError(
        503,
        f"gave up after {backend.config.max_attempts} attempts: {progress.last_error}",
        None,
        "unavailable",
        1,
    )


async def _attempt(
    backend: Backend,
    route: Route,
    request_id: str,
    sample: Sample,
    ticket: Ticket,
    progress: Progress,
    outcome: list[Outcome],
) -> AsyncIterator[pm.TokenChunk]:
    """One attempt's chunks; its outcome goes in ``outcome`` (APIError: the sample fails)."""
    queue = backend.nodes.open(request_id)
    finished = False
    try:
        node_params = dataclasses.replace(sample.params, stop=())  # stop strings: the router's
        context = None if progress.trace is None else progress.trace.context()
        await _send(backend, route, request_id, sample, node_params, tuple(progress.relayed), context)
        _note_route(backend, route, sample, progress)
        async for chunk in _relay(backend, route, queue, sample, ticket, progress):
            finished = chunk.finish_reason is not None
            progress.relayed.extend(chunk.token_ids)
            if finished and progress.trace is not None:
                progress.trace.ended(Done(), None)  # before the client can have its answer
            yield chunk
        outcome.append(Done())
    except _Retry as retry:
        outcome.append(Retry(retry.node_id, str(retry), retry.blame))
    except APIError as exc:  # after tokens: the decode node died or stalled
        outcome.append(_after_tokens(backend.config, route, progress, exc))
    finally:
        backend.nodes.close_request(request_id)
        backend.policy.finish(request_id)
        if not finished:
            _abort(backend, route, request_id)
        if progress.trace is not None:
            progress.trace.ended(outcome[0] if outcome else Done() if finished else None, sys.exception())


def _note_route(backend: Backend, route: Route, sample: Sample, progress: Progress) -> None:
    """Record the attempt just sent on the sample's trail; warn when a prompt that could have
    been disaggregated is prefilled locally beside an idle prefill pool."""
    resumed = bool(progress.relayed)
    progress.trail.sent(route, resumed)
    leg = progress.trail.current
    if not resumed and leg is not None:
        warn_if_prefill_idle(route, leg, len(sample.prompt_ids), backend.registry.snapshot())


def _after_tokens(config: RouterConfig, route: Route, progress: Progress, exc: APIError) -> Outcome:
    """What a failure after tokens leads to: a migration, a replay, or (raised) the error."""
    if exc.status not in (502, 504):
        raise exc
    if config.migrate and progress.num_migrations < config.max_migrations:
        return Migrate(route.decode.node_id, exc)
    if config.migrate or not progress.replayable or progress.num_retries + 1 >= config.max_attempts:
        raise exc
    return Replay(exc.message)


def _count(
    backend: Backend, sample: Sample, progress: Progress, result: Retry | Migrate | Replay, attempt: int
) -> bool:
    """Book a failed attempt; False when no attempt is left."""
    metrics, name = backend.metrics, sample.request_id
    if isinstance(result, Migrate):
        progress.last_error = result.error.message
        progress.excluded.add(result.node_id)
        progress.migrating = result
        progress.num_migrations += 1
        metrics.migrations.inc()
        how = f"failed after {len(progress.relayed)} tokens ({result.error.message}); resuming it on another node"
    elif isinstance(result, Replay):
        progress.last_error = result.reason
        progress.num_retries += 1
        progress.relayed.clear()  # a dead decode node leaves the registry; a live one may serve the replay
        metrics.retries.inc()
        how = f"failed after tokens ({result.reason}); replaying it from scratch"
    else:
        progress.last_error = result.reason
        progress.num_retries += 1
        if result.blame:
            progress.excluded.add(result.node_id)
        metrics.retries.inc()
        if progress.num_retries >= backend.config.max_attempts:
            return False
        again = "trying another pair" if result.blame else "routing it again"
        how = f"failed before its first token ({result.reason}); {again}"
    log.warning("sample %s: attempt %d %s", name, attempt + 1, how)
    return True


async def _send(
    backend: Backend,
    route: Route,
    request_id: str,
    sample: Sample,
    params: SamplingParams,
    resume: tuple[int, ...],
    trace: pm.TraceContext | None = None,
) -> None:
    target = route.prefill or route.decode
    if resume:  # the client has the prompt logprobs: they came with the first token
        params = dataclasses.replace(params, prompt_logprobs=None)
    request = pm.GenerateRequest(
        request_id=request_id,
        token_ids=sample.prompt_ids,
        sampling_params=params,
        reply_addr=backend.nodes.reply_addr,
        decode_addr=route.decode.kv_addr if route.prefill else None,
        deadline=sample.arrival_time + backend.config.request_ttl_s,
        arrival_time=sample.arrival_time,
        output_token_ids=resume,
        trace=trace,
    )
    now = time.time()
    backend.policy.record(
        request_id, route, len(sample.prompt_ids) + len(resume), now
    )  # seen by others at once
    try:
        await backend.nodes.send(target.control_addr, request)
    except NodeUnavailable as exc:
        raise _Retry(target.node_id, str(exc)) from None
    backend.metrics.queue.observe(now - sample.arrival_time)
    backend.metrics.routes.labels(prefill=route.placement.value).inc()


async def _relay(
    backend: Backend,
    route: Route,
    queue: asyncio.Queue[pm.TokenChunk | pm.RequestFailed],
    sample: Sample,
    ticket: Ticket,
    progress: Progress,
) -> AsyncIterator[pm.TokenChunk]:
    """One attempt's chunks, from the tokens a migrated sample resumes after (its TTFT was
    counted already when there are any); its first one is booked on the sample's trail."""
    start = len(progress.relayed)
    resumed = start > 0
    num_tokens = 0
    first_token_time = 0.0
    async for msg in _in_order(backend, route, queue, start, _reply_timeout_s(backend.config, sample)):
        if isinstance(msg, pm.RequestFailed):
            if msg.retryable and num_tokens == 0:
                # The prefill node reports the decode node's refusal: that one is to avoid.
                blamed = route.decode.node_id if msg.code is FailureCode.DECODE_REJECTED else msg.node_id
                raise _Retry(blamed, f"{msg.node_id}: {msg.code}: {msg.message}")
            raise _node_error(msg, after_tokens=num_tokens > 0)
        if num_tokens == 0:
            first_token_time = time.time()
            ticket.release(Stage.PREFILL)
            backend.policy.remember_prefix(route)
            _first_output(backend, progress.trail, resumed)
            if progress.trace is not None:
                progress.trace.first_token(resumed)
            if not resumed:
                backend.metrics.ttft.observe(first_token_time - sample.arrival_time)
        num_tokens += len(msg.token_ids)
        _observe_timings(backend.metrics, msg.timings)
        if msg.finish_reason is not None:
            _observe_end(backend.metrics, sample, first_token_time, num_tokens, resumed)
        yield msg
        if msg.finish_reason is not None:
            return


def _first_output(backend: Backend, trail: RouteTrail, resumed: bool) -> None:
    """An attempt's first token: the trail knows which leg served; a sample's first counts in
    /metrics by its path and reason."""
    trail.first_output()
    leg = trail.served
    if not resumed and leg is not None:
        backend.metrics.paths.labels(path=str(leg.path), reason=str(leg.reason or "none")).inc()


def _reply_timeout_s(config: RouterConfig, sample: Sample) -> float:
    """How long an attempt waits for each reply. A beam search answers once, when the search is
    over: it waits as long as the request may live (a node that dies is still seen at once)."""
    if sample.params.beam_search is None:
        return config.chunk_timeout_s
    return max(config.chunk_timeout_s, sample.arrival_time + config.request_ttl_s - time.time())


async def _in_order(
    backend: Backend,
    route: Route,
    queue: asyncio.Queue[pm.TokenChunk | pm.RequestFailed],
    start: int,
    timeout_s: float,
) -> AsyncIterator[pm.TokenChunk | pm.RequestFailed]:
    """The attempt's replies in output order, from ``start`` (the tokens a migrated sample resumes
    after). The prefill and the decode node push on separate sockets, so a chunk may overtake an
    earlier one: each says where its tokens start, one that comes early waits for those before
    it, and a repeat is dropped."""
    ahead: dict[int, pm.TokenChunk] = {}  # at most the queue's bound: each came out of it
    expected = start
    while True:
        msg: pm.TokenChunk | pm.RequestFailed | None = ahead.pop(expected, None)
        if msg is None:
            msg = await _next_reply(backend, route, queue, expected > start, timeout_s)
            if isinstance(msg, pm.TokenChunk) and msg.position != expected:
                if msg.position > expected:
                    ahead[msg.position] = msg
                continue
        if isinstance(msg, pm.TokenChunk):
            expected += len(msg.token_ids)
        yield msg


def _observe_end(
    metrics: RouterMetrics, sample: Sample, first_token_time: float, num_tokens: int, resumed: bool
) -> None:
    now = time.time()
    metrics.e2e.observe(now - sample.arrival_time)
    if num_tokens > 1 and not resumed:
        metrics.tpot.observe((now - first_token_time) / (num_tokens - 1))


async def _next_reply(
    backend: Backend,
    route: Route,
    queue: asyncio.Queue[pm.TokenChunk | pm.RequestFailed],
    after_tokens: bool,
    timeout_s: float,
) -> pm.TokenChunk | pm.RequestFailed:
    """The next reply, or _Retry / APIError when none comes in ``timeout_s`` or a node leaves."""
    deadline = time.monotonic() + timeout_s
    waiting_on = [route.decode] if after_tokens or route.prefill is None else [route.prefill, route.decode]
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if after_tokens:
                raise APIError(
                    504,
                    f"no output from {route.decode.node_id} for {timeout_s:g} s",
                    None,
                    "timeout",
                )
            raise _Retry(waiting_on[0].node_id, f"no reply from {waiting_on[0].node_id} in time")
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that lands as the
            # reply does, and a sample whose client left would then run (and hold its blocks) to the end.
            async with asyncio.timeout(min(remaining, _LIVENESS_CHECK_S)):
                return await queue.get()
        except TimeoutError:
            pass
        gone = next((n for n in waiting_on if not backend.registry.is_alive(n.node_id)), None)
        if gone is not None and queue.empty():
            if after_tokens:
                raise APIError(502, f"decode node {gone.node_id} went away mid-stream", None, "node_lost")
            raise _Retry(gone.node_id, f"{gone.node_id} left the registry", blame=False)


def _abort(backend: Backend, route: Route, request_id: str) -> None:
    for node in (route.prefill, route.decode):
        if node is not None:
            backend.nodes.send_nowait(
                node.control_addr, pm.AbortRequest(request_id=request_id, reason="router")
            )


def _observe_timings(metrics: RouterMetrics, timings: pm.StageTimings | None) -> None:
    if timings is None:
        return
    if timings.kv_bytes is not None:
        metrics.kv_bytes.inc(timings.kv_bytes)
    for stage, seconds in timings.seconds().items():
        metrics.stages.labels(stage=stage).observe(seconds)
