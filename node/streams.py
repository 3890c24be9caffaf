"""Per-request state a node keeps to stream tokens back to the router, and the node's status record."""

from __future__ import annotations

import dataclasses
import time

from pdserve.engine.core.outputs import CompletionOutput
from pdserve.engine.core.sequence import TokenLogprob
from pdserve.engine.llm_engine import LLMEngine
from pdserve.node.options import NodeOptions
from pdserve.protocol.fingerprint import KVFingerprint
from pdserve.protocol.messages import BeamOutput, StageTimings, TokenChunk, TokenLogprobs, TraceContext
from pdserve.protocol.registry import NodeInfo


@dataclasses.dataclass(slots=True)
class Stream:
    request_id: str
    reply_addr: str  # router's PULL address
    num_prompt_tokens: int
    deadline: float  # time.monotonic() past which the node drops the request
    num_sent: int = 0  # output tokens already sent to the router (by this node or the prefill node)
    num_resumed: int = 0  # of those, the ones a migrated request came with (no logprobs here)
    num_cached_tokens: int = 0  # usage: prompt tokens from a prefix cache
    timings: dict = dataclasses.field(
        default_factory=dict
    )  # StageTimings fields so far, sent with the last chunk
    started: float = dataclasses.field(default_factory=time.monotonic)  # arrival on this node
    adopted_at: float | None = None  # decode nodes: when the transferred KV was adopted
    trace: TraceContext | None = None  # where its spans hang (node/spans.py); None: not traced
    first_emit_at: float | None = None  # decode nodes, traced: when its first tokens left


def local_deadline(deadline: float, cap_s: float) -> float:
    """``time.monotonic()`` at which a request with wall-clock ``deadline`` must be dropped here,
    never later than ``cap_s`` (the node's own limit) from now."""
    return time.monotonic() + max(0.0, min(deadline - time.time(), cap_s))


def next_chunk(
    stream: Stream,
    out: CompletionOutput,
    node_id: str,
    is_first: bool = False,
    prompt_logprobs: list[TokenLogprob] | None = None,
) -> TokenChunk | None:
    """The chunk carrying ``out``'s tokens the router has not seen yet (None when nothing is new),
    and ``prompt_logprobs`` when given (the first chunk of the node that ran the prompt)."""
    new = out.token_ids[stream.num_sent :]
    if not new and out.finish_reason is None:
        return None
    logprobs = tuple(wire_logprob(lp) for lp in (out.logprobs or [])[stream.num_sent - stream.num_resumed :])
    position, stream.num_sent = stream.num_sent, len(out.token_ids)
    timings = StageTimings(**stream.timings) if out.finish_reason is not None else None
    return TokenChunk(
        request_id=stream.request_id,
        node_id=node_id,
        token_ids=tuple(new),
        logprobs=logprobs,
        finish_reason=out.finish_reason,
        num_prompt_tokens=stream.num_prompt_tokens,
        num_cached_tokens=stream.num_cached_tokens,
        is_first=is_first,
        timings=timings,
        prompt_logprobs=tuple(wire_logprob(lp) for lp in prompt_logprobs or ()),
        position=position,
    )


def beam_output(out: CompletionOutput) -> BeamOutput:
    """A finished beam besides the best one (TokenChunk.beams)."""
    assert out.finish_reason is not None, "a beam is answered once it has finished"
    return BeamOutput(
        token_ids=tuple(out.token_ids),
        logprobs=tuple(wire_logprob(lp) for lp in out.logprobs or ()),
        finish_reason=out.finish_reason,
    )


def wire_logprob(lp: TokenLogprob) -> TokenLogprobs:
    top_ids, top_values = tuple(t for t, _ in lp.top), tuple(v for _, v in lp.top)
    return TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, top_token_ids=top_ids, top_logprobs=top_values, rank=lp.rank
    )


def engine_logprob(lp: TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs, strict=True)))


def node_status(
    opts: NodeOptions,
    engine: LLMEngine,
    control_addr: str,
    kv_addr: str | None,
    fingerprint: KVFingerprint,
    draining: bool,
) -> NodeInfo:
    stats = engine.stats()  # the one snapshot of the engine a node reads
    return NodeInfo(
        node_id=opts.node_id,
        role=opts.role,
        control_addr=control_addr,
        kv_addr=kv_addr,
        fingerprint=fingerprint,
        max_model_len=stats.max_model_len,
        num_blocks_total=stats.num_blocks_total,
        num_blocks_free=stats.num_blocks_free,
        num_blocks_cached=stats.num_blocks_cached,
        num_blocks_committed=stats.num_blocks_committed,
        torch_threads=stats.torch_threads,
        num_running=stats.num_running,
        num_queued=stats.num_waiting + stats.num_receiving,  # receiving: not decoding yet
        num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
        draining=draining,
        heartbeat_time=time.time(),
        prefill_tokens_per_s=stats.prefill_tokens_per_s,
        device=stats.device,
        tp_size=engine.config.tensor_parallel_size,
        step_stats=stats.step_stats,
        step_target_s=stats.step_target_s,
        speculation=stats.speculation,
        kv_offload=stats.offload,
        max_lora_rank=engine.config.max_lora_rank if engine.config.enable_lora else None,
        adapters=tuple(a.name for a in stats.adapters if a.slot is not None),
        adapter_counts={
            a.name: {"requests": a.num_requests, "loads": a.num_loads, "evictions": a.num_evictions}
            for a in stats.adapters
        },
    )
