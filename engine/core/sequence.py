"""One sequence (one sample of one request) as the scheduler and block manager see it."""

from __future__ import annotations

import dataclasses
import enum
import itertools

from pdserve.protocol.block_hash import cache_root_of
from pdserve.protocol.reasons import FinishReason
from pdserve.protocol.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; may hold prefix blocks from an earlier (preempted) run
    WAITING_FOR_KV = "waiting_for_kv"  # decode node: its prompt KV comes from a peer (queued, then granted)
    RUNNING = "running"  # scheduled every iteration until it finishes
    HELD_FOR_TRANSFER = "held_for_transfer"  # prefill node: first token out, KV kept for the transfer
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context reached
    FINISHED_ABORTED = "finished_aborted"  # cancelled by the client or a failure

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )

    @property
    def done(self) -> bool:
        """Nothing more to compute: finished, or held for a transfer (its output is final)."""
        return self.finished or self is SequenceStatus.HELD_FOR_TRANSFER


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of a sampled token and its top alternatives (OpenAI's logprobs)."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability under the model
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the most likely tokens, best first
    rank: int | None = None  # prompt tokens: 1 + how many tokens were more likely (vLLM's rank)


_seq_counter = itertools.count()


@dataclasses.dataclass(eq=False, slots=True)
class Sequence:
    request_id: str  # the request this sample belongs to
    token_ids: list[int]  # prompt then generated tokens
    num_prompt_tokens: int  # length of the prompt part of token_ids
    params: SamplingParams  # how to sample
    index: int = 0  # which of the request's n samples
    arrival_time: float = 0.0  # when the request came in (scheduling order)
    seq_id: int = dataclasses.field(default_factory=lambda: next(_seq_counter))  # process-unique id
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # leading tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of the prompt, how many came from the prefix cache (usage)
    block_table: list[int] = dataclasses.field(default_factory=list)  # block ids in token order
    block_hashes: list[int] = dataclasses.field(default_factory=list)  # hashes of full, computed blocks
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # per output token, if asked
    # params.prompt_logprobs: of prompt tokens 1.. in order, as their positions are computed
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    max_tokens: int = 0  # resolved output limit (params.max_tokens or what the context leaves)
    num_preemptions: int = 0  # times its KV was dropped and recomputed
    stop_text: str | None = None  # the stop string that ended it, if any
    first_scheduled_time: float | None = None  # time.monotonic() when it first got compute (queue time)
    finish_status: SequenceStatus | None = None  # how it ended (a held sequence's, once released)
    # speculative decoding: tokens proposed after token_ids for this step to verify (engine/sampling/speculation.py)
    draft_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def cache_root(self) -> int | None:
        """Where its blocks' hash chain starts: its adapter's and cache salt's (None: neither)."""
        return cache_root_of(self.params.adapter, self.params.cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs, and some are still to be computed (by the first sample: its
        siblings fork off its computed prompt)."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why it ended, once it has (held for a transfer or not)."""
        return None if self.finish_status is None else FINISH_REASONS[self.finish_status]
