"""Per-request state a node keeps to stream tokens back to the router, and the node's status record."""

from __future__ import annotations

import dataclasses
import time

from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput
from engine.sequence import TokenLogprob
from node.options import NodeOptions
from protocol.messages import TokenChunk, TokenLogprobs
from protocol.registry import NodeInfo


@dataclasses.dataclass(slots=True)
class Stream:
    request_id: str
    reply_addr: str  # router's PULL address
    num_prompt_tokens: int
    deadline: float  # time.monotonic() past which the node drops the request
    num_sent: int = 0  # output tokens already sent to the router (by this node or the prefill node)
    num_cached_tokens: int = 0  # usage: prompt tokens from a prefix cache
    timings: dict = dataclasses.field(default_factory=dict)  # seconds per stage, sent with the last chunk
    started: float = dataclasses.field(default_factory=time.monotonic)  # arrival on this node
    adopted_at: float | None = None  # decode nodes: when the transferred KV was adopted


def next_chunk(stream: Stream, out: CompletionOutput, node_id: str, is_first: bool = False) -> TokenChunk | None:
    """The chunk carrying ``out``'s tokens the router has not seen yet (None when nothing is new)."""
    new = out.token_ids[stream.num_sent:]
    if not new and out.finish_reason is None:
        return None
    logprobs = tuple(wire_logprob(lp) for lp in (out.logprobs or [])[stream.num_sent:])
    stream.num_sent = len(out.token_ids)
    timings = dict(stream.timings) if out.finish_reason is not None else None
    return TokenChunk(stream.request_id, node_id, tuple(new), logprobs, out.finish_reason,
                      stream.num_prompt_tokens, stream.num_cached_tokens, is_first, timings)


def wire_logprob(lp: TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(lp.token_id, lp.logprob, tuple(t for t, _ in lp.top), tuple(v for _, v in lp.top))


def engine_logprob(lp: TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs, strict=True)))


def node_status(opts: NodeOptions, engine: LLMEngine, control_addr: str, kv_addr: str | None,
                fingerprint: dict, draining: bool, extra_queued: int = 0) -> NodeInfo:
    bm, sched = engine.block_manager, engine.scheduler
    queued_tokens = sum(s.num_uncomputed_tokens for s in sched.waiting)
    queued_tokens += sum(s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1)
    return NodeInfo(
        node_id=opts.node_id, role=opts.role, control_addr=control_addr, kv_addr=kv_addr,
        fingerprint=fingerprint, max_model_len=engine.max_model_len, num_blocks_total=bm.num_blocks,
        num_blocks_free=bm.num_free_blocks, num_blocks_cached=bm.num_cached_free_blocks,
        num_running=len(sched.running), num_queued=len(sched.waiting) + extra_queued,
        num_queued_prefill_tokens=queued_tokens, draining=draining, heartbeat_time=time.time(),
    )
