"""What the engine reports per request (shaped like vLLM's, so its users feel at home)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pdserve.engine.core.sequence import Sequence, SequenceStatus, TokenLogprob
from pdserve.protocol.reasons import FinishReason

if TYPE_CHECKING:
    from pdserve.engine.lora.registry import AdapterStats


@dataclasses.dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n samples
    token_ids: list[int]  # generated tokens so far (EOS included when it ended the sample)
    text: str  # detokenized output, cut before a matched stop string ("" without a tokenizer)
    finish_reason: FinishReason | None  # None while running (a str: "stop", "length", "abort")
    logprobs: list[TokenLogprob] | None  # one per token when SamplingParams.logprobs was set
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


def completion_output(seq: Sequence, tokenizer=None) -> CompletionOutput:
    """What a sequence has produced; its text is decoded once, when it is done, and cut before
    the stop string that ended it."""
    text = ""
    if tokenizer is not None and seq.status.done:
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if seq.stop_text is not None:
            cut = text.find(seq.stop_text)
            text = text[:cut] if cut >= 0 else text
    stop_reason: str | int | None = seq.stop_text
    if stop_reason is None and seq.finish_status is SequenceStatus.FINISHED_STOPPED:
        stop_reason = seq.token_ids[-1]
    return CompletionOutput(
        seq.index,
        list(seq.output_token_ids),
        text,
        seq.finish_reason,
        list(seq.logprobs) if seq.params.logprobs is not None else None,
        stop_reason,
    )


@dataclasses.dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: one entry per prompt token after the first (vLLM's list has a
    # None for the first); None when not asked for or not all computed yet
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """One snapshot of an engine's state, for the node that serves it (its status record and
    loop): what it reads of the engine, in one place, instead of the engine's parts."""

    max_model_len: int
    device: str
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_cached: int  # free blocks that still hold a prefix (evictable)
    num_blocks_committed: int  # pool blocks whose memory is committed (engine/executor/kv_prefault.py)
    torch_threads: int  # what the engine runs with now (engine/machine/cpu_share.py)
    num_running: int
    num_waiting: int  # local prompts and remote ones queued for blocks
    num_receiving: int  # remote requests granted blocks, their KV still arriving
    num_held: int  # prefill-only requests whose KV is held for a transfer
    num_queued_prefill_tokens: int  # prompt tokens not computed yet
    step_stats: dict  # engine steps by kind since start (engine/core/step_stats.py)
    # prompt tokens per second of its recent large prompt steps (step_stats.PrefillRate); None until one
    prefill_tokens_per_s: float | None = None
    # the step-time target of steps that compute prompt tokens (engine.step_budget): what a running
    # decode's time per token stretches to while a prompt is prefilled beside it; None until known
    step_target_s: float | None = None
    # speculative decoding's counts since start (engine.speculation.SpecStats); None when it is off
    speculation: dict[str, int] | None = None
    # each LoRA adapter served (engine/lora/registry.py): its slot, requests, loads, evictions
    adapters: tuple[AdapterStats, ...] = ()
    # the KV offload tier's counts since start (engine/offload/tiers.py OffloadStats); None when off
    offload: dict[str, int] | None = None
