"""One sample (n == 1) through the cluster: pick a pair, send, relay its chunks, fail over.

    attempt k:  choose (P, D) ─► GenerateRequest to P (decode_addr = D.kv_addr) or to D alone
                ◄─ TokenChunk(is_first) from P, then TokenChunks from D until finish_reason

This is the router's one retry loop, with request ids ``{id}``, ``{id}.r1``, ``{id}.r2``...
Before an attempt's first token, a retryable RequestFailed, a timeout or a node leaving sends the
sample to another pair (the node to blame excluded), ``max_attempts`` tries in all. After tokens,
when the decode node dies or stalls, the sample *migrates* (up to ``max_migrations`` times): a
decode node elsewhere gets the prompt plus every token already relayed
(``GenerateRequest.output_token_ids``), recomputes their KV and goes on, so the client's stream
continues with no gap and no repeated token; positions, penalties and seeded draws (a function of
seed, sample and position) go on as if uninterrupted, so a greedy or seeded continuation equals
the undisturbed output. With migration off (``--no-migration``), a non-streamed sample is
replayed from scratch (the caller gets ``RESTART`` and drops what it had) and a streamed one
fails with an error event. Whenever an attempt ends without a finish_reason (error, stop string,
client gone) both its nodes get an AbortRequest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator

from protocol import messages as pm
from protocol.reasons import FailureCode
from protocol.sampling_params import SamplingParams
from router.admission import Stage, Ticket
from router.config import RouterConfig
from router.errors import APIError
from router.metrics import RouterMetrics
from router.node_client import NodeClient, NodeUnavailable
from router.policy import Route, RoutingPolicy
from router.registry_client import NodeRegistry

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


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    request_id: str  # unique across the cluster; retries add ".r<k>"
    prompt_ids: tuple[int, ...]
    params: SamplingParams  # n == 1, max_tokens set; stop strings stay in the router
    arrival_time: float  # router wall clock when the HTTP request arrived


class _Retry(Exception):
    def __init__(self, node_id: str, reason: str) -> None:
        super().__init__(reason)
        self.node_id = node_id  # excluded from the next attempts


def _node_error(failed: pm.RequestFailed, after_tokens: bool) -> APIError:
    if failed.code is FailureCode.BAD_REQUEST:
        return APIError(
            400, f"node {failed.node_id} rejected the request: {failed.message}", None, "bad_request"
        )
    status = (
        503 if failed.code in (FailureCode.OVERLOADED, FailureCode.DRAINING) and not after_tokens else 502
    )
    return APIError(
        status,
        f"node {failed.node_id} failed: {failed.code}: {failed.message}",
        None,
        failed.code,
        1 if status == 503 else None,
    )


RESTART = object()  # run_sample: what came so far is void, the sample starts again elsewhere


@dataclasses.dataclass(frozen=True, slots=True)
class _MidOutput:
    node_id: str  # the decode node that failed after tokens were relayed
    error: APIError  # what the client gets if the sample cannot migrate


def _choose(backend: Backend, sample: Sample, relayed: list[int], excluded: set[str]) -> Route | None:
    return backend.policy.choose(
        backend.registry.snapshot(),
        (*sample.prompt_ids, *relayed),
        (sample.params.max_tokens or 1) - len(relayed),
        frozenset(excluded),
        disaggregate=not relayed,  # a migrated sample resumes on a decode node alone
    )


async def run_sample(
    backend: Backend, sample: Sample, ticket: Ticket, replay_after_tokens: bool = False
) -> AsyncIterator[pm.TokenChunk | object]:
    """The sample's chunks, in order, the last with a finish_reason (or RESTART, then the chunks
    of a replay, when ``replay_after_tokens`` and migration is off); APIError on failure."""
    config = backend.config
    node_params = dataclasses.replace(sample.params, stop=())
    excluded: set[str] = set()
    relayed: list[int] = []  # output token ids the caller has, over every attempt
    num_retries = num_migrations = 0
    last_error = "no attempt made"
    failed_mid_output: APIError | None = None  # why the sample is migrating
    for attempt in itertools.count():
        route = _choose(backend, sample, relayed, excluded)
        if route is None and failed_mid_output is not None:
            # No other node: the one that failed may serve its own migration if it still lives.
            excluded.discard(failed_mid_output.node_id)
            route = _choose(backend, sample, relayed, excluded)
        if route is None:
            if failed_mid_output is not None:
                raise failed_mid_output.error
            raise APIError(503, f"no usable decode node ({last_error})", None, "no_nodes", 1)
        request_id = sample.request_id if attempt == 0 else f"{sample.request_id}.r{attempt}"
        queue = backend.nodes.open(request_id)
        finished = False
        try:
            await _send(backend, route, request_id, sample, node_params, tuple(relayed))
            async for chunk in _relay(backend, route, queue, sample, ticket, resumed=bool(relayed)):
                finished = chunk.finish_reason is not None
                relayed.extend(chunk.token_ids)
                yield chunk
            return
        except _Retry as retry:
            num_retries += 1
            excluded.add(retry.node_id)
            last_error = str(retry)
            backend.metrics.retries.inc()
            if num_retries >= config.max_attempts:
                break
            log.warning(
                "sample %s: attempt %d failed before its first token (%s); trying another pair",
                sample.request_id,
                attempt + 1,
                retry,
            )
        except APIError as exc:  # after tokens: the decode node died or stalled
            if exc.status not in (502, 504):
                raise
            last_error = exc.message
            if config.migrate and num_migrations < config.max_migrations:
                excluded.add(route.decode.node_id)
                failed_mid_output = _MidOutput(route.decode.node_id, exc)
                num_migrations += 1
                backend.metrics.migrations.inc()
                log.warning(
                    "sample %s: attempt %d failed after %d tokens (%s); resuming it on another node",
                    sample.request_id,
                    attempt + 1,
                    len(relayed),
                    exc.message,
                )
                continue
            if config.migrate or not replay_after_tokens or num_retries + 1 >= config.max_attempts:
                raise
            num_retries += 1
            relayed.clear()  # a dead decode node leaves the registry; a live one may serve the replay
            backend.metrics.retries.inc()
            log.warning(
                "sample %s: attempt %d failed after tokens (%s); replaying it from scratch",
                sample.request_id,
                attempt + 1,
                exc.message,
            )
            yield RESTART
        finally:
            backend.nodes.close_request(request_id)
            backend.policy.finish(request_id)
            if not finished:
                _abort(backend, route, request_id)
    raise APIError(503, f"gave up after {config.max_attempts} attempts: {last_error}", None, "unavailable", 1)


async def _send(
    backend: Backend,
    route: Route,
    request_id: str,
    sample: Sample,
    params: SamplingParams,
    resume: tuple[int, ...],
) -> None:
    target = route.prefill or route.decode
    if resume:  # the client has the prompt logprobs: they came with the first token
        params = dataclasses.replace(params, prompt_logprobs=None)
    request = pm.GenerateRequest(
        request_id,
        sample.prompt_ids,
        params,
        backend.nodes.reply_addr,
        route.decode.kv_addr if route.prefill else None,
        sample.arrival_time + backend.config.request_ttl_s,
        sample.arrival_time,
        resume,
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
    queue: asyncio.Queue[pm.Message],
    sample: Sample,
    ticket: Ticket,
    resumed: bool = False,
) -> AsyncIterator[pm.TokenChunk]:
    """One attempt's chunks; ``resumed``: a migrated sample's (its TTFT was counted already)."""
    num_tokens = 0
    first_token_time = 0.0
    # Prefill and decode node push on separate sockets: the decode node's first chunk may
    # overtake the prefill node's first token. Hold such chunks until the first token came.
    early: list[pm.TokenChunk] = []
    while True:
        if early and num_tokens > 0:
            msg = early.pop(0)
        else:
            msg = await _next_reply(backend, route, queue, after_tokens=num_tokens > 0)
        if (
            isinstance(msg, pm.TokenChunk)
            and route.prefill is not None
            and num_tokens == 0
            and not msg.is_first
        ):
            early.append(msg)
            continue
        if isinstance(msg, pm.RequestFailed):
            if msg.retryable and num_tokens == 0:
                # The prefill node reports the decode node's refusal: that one is to avoid.
                blamed = route.decode.node_id if msg.code is FailureCode.DECODE_REJECTED else msg.node_id
                raise _Retry(blamed, f"{msg.node_id}: {msg.code}: {msg.message}")
            raise _node_error(msg, after_tokens=num_tokens > 0)
        assert isinstance(msg, pm.TokenChunk)
        if num_tokens == 0:
            first_token_time = time.time()
            ticket.release(Stage.PREFILL)
            backend.policy.remember_prefix(route)
            if not resumed:
                backend.metrics.ttft.observe(first_token_time - sample.arrival_time)
        num_tokens += len(msg.token_ids)
        _observe_timings(backend.metrics, msg.timings)
        if msg.finish_reason is not None:
            now = time.time()
            backend.metrics.e2e.observe(now - sample.arrival_time)
            if num_tokens > 1 and not resumed:
                backend.metrics.tpot.observe((now - first_token_time) / (num_tokens - 1))
        yield msg
        if msg.finish_reason is not None:
            return


async def _next_reply(
    backend: Backend, route: Route, queue: asyncio.Queue[pm.Message], after_tokens: bool
) -> pm.Message:
    """The next reply, or _Retry / APIError when none comes in time or a node leaves."""
    deadline = time.monotonic() + backend.config.chunk_timeout_s
    waiting_on = [route.decode] if after_tokens or route.prefill is None else [route.prefill, route.decode]
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if after_tokens:
                raise APIError(
                    504,
                    f"no output from {route.decode.node_id} for {backend.config.chunk_timeout_s:g} s",
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
            raise _Retry(gone.node_id, f"{gone.node_id} left the registry")


def _abort(backend: Backend, route: Route, request_id: str) -> None:
    for node in (route.prefill, route.decode):
        if node is not None:
            backend.nodes.send_nowait(node.control_addr, pm.AbortRequest(request_id, "router"))


def _observe_timings(metrics: RouterMetrics, timings: dict | None) -> None:
    for stage, value in (timings or {}).items():
        if stage == "kv_bytes" and isinstance(value, int):
            metrics.kv_bytes.inc(max(value, 0))  # a node's bad count must not fail the request
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics.stages.labels(stage=str(stage)).observe(float(value))
