"""An engine's requests: what one is, the checks it must pass, and what the engine answers about it."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.sampling.beam_search import BeamSearch, num_candidates, stop_ids_of
from pdserve.engine.sampling.logits_rules import LogitsRules
from pdserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.core.scheduler import Scheduler
    from pdserve.engine.lora.registry import AdapterRegistry


class QueueFullError(RuntimeError):
    """The engine's bounded waiting queue is full; retry later."""


class Aborted(enum.Enum):
    """Where ``abort_request`` found the request: which transfer, if any, the caller must stop."""

    UNKNOWN = "unknown"  # not here (it finished, or never came): falsy
    LOCAL = "local"  # waiting or computing here; no transfer touches it
    KV_INBOUND = "kv_inbound"  # its prompt KV was coming from a peer (queued or granted): stop that
    KV_OUTBOUND = "kv_outbound"  # held for a transfer of its KV to a peer

    def __bool__(self) -> bool:
        return self is not Aborted.UNKNOWN


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]  # one until the prompt is prefilled, then n (forks share its blocks)
    # beam search: the search; ``seqs`` are its running beams, then (once it is done) its answer
    search: BeamSearch | None = None

    @property
    def finished(self) -> bool:
        if self.search is not None:
            return self.search.done
        return len(self.seqs) == self.params.n and all(s.status.done for s in self.seqs)


def check_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    block_manager: BlockManager,
    tokenizer,
    rules: LogitsRules | None,
    max_num_seqs: int,
    eos_token_ids: tuple[int, ...],
    adapters: AdapterRegistry | None = None,
) -> int:
    """A request's resolved max_tokens; ValueError naming the field it cannot be served for.
    ``adapters``: the engine's served LoRA adapters (None: LoRA is off)."""
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("prompt must not be empty")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    if num_prompt >= max_model_len:
        raise ValueError(
            f"prompt: {num_prompt} tokens leave no room in the model's context of {max_model_len} tokens"
        )
    room = max_model_len - num_prompt
    if params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(
            f"max_tokens: {params.max_tokens} + {num_prompt} prompt tokens exceed the "
            f"model's context of {max_model_len} tokens"
        )
    max_tokens = params.max_tokens or room
    blocks = block_manager.blocks_needed(num_prompt + max_tokens)
    if blocks > block_manager.num_blocks:
        raise ValueError(
            f"prompt: {num_prompt} tokens + max_tokens {max_tokens} need {blocks} KV blocks, "
            f"more than this engine's {block_manager.num_blocks}"
        )
    if params.beam_search is not None:
        _check_beams(params, num_prompt, max_tokens, vocab_size, block_manager, max_num_seqs, eos_token_ids)
    if params.adapter is not None:
        if adapters is None:
            raise ValueError(
                f"adapter: LoRA adapters are not enabled on this engine (enable_lora; {params.adapter!r})"
            )
        adapters.check(params.adapter, params.adapter_path)
    chosen = params.logprob_token_ids or ()
    if any(not 0 <= t < vocab_size for t in chosen):
        raise ValueError(f"logprob_token_ids: token ids must be integers in [0, {vocab_size})")
    if params.stop and tokenizer is None:
        raise ValueError("stop: stop strings need a tokenizer")
    if params.has_logits_rules:
        if rules is None:
            raise ValueError("logits rules (guided decoding, logit_bias, ...) are off on this engine")
        rules.check(params)
    return max_tokens


def _check_beams(
    params: SamplingParams,
    num_prompt: int,
    max_tokens: int,
    vocab_size: int,
    block_manager: BlockManager,
    max_num_seqs: int,
    eos_token_ids: tuple[int, ...],
) -> None:
    """Beams advance together, so all n must fit this engine at once: slots, and blocks for the
    prompt and n outputs (each with a block of its own that copy-on-write may take)."""
    n = params.n
    if n > max_num_seqs:
        raise ValueError(f"n: {n} beams exceed this engine's {max_num_seqs} sequences at a time")
    if num_candidates(params, len(stop_ids_of(params, eos_token_ids))) > vocab_size:
        raise ValueError(f"n: {n} beams need more candidates per step than the vocabulary's {vocab_size}")
    need = block_manager.blocks_needed(num_prompt) + n * (block_manager.blocks_needed(max_tokens) + 1)
    spare = block_manager.num_blocks - max(1, block_manager.num_blocks // 100)  # the scheduler's watermark
    if need > spare:
        raise ValueError(
            f"n: {n} beams of a {num_prompt}-token prompt and max_tokens {max_tokens} need {need} KV "
            f"blocks at once, more than this engine's {spare}"
        )


def check_resume(
    output_ids: tuple[int, ...], params: SamplingParams, max_tokens: int, prefill_only: bool, vocab_size: int
) -> None:
    """A migrated request's output so far, to resume after; ValueError when it cannot be."""
    if prefill_only or params.n != 1:
        raise ValueError("output_token_ids: only a single sample decoded here can resume")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in output_ids):
        raise ValueError(f"output_token_ids: token ids must be integers in [0, {vocab_size})")
    if len(output_ids) >= max_tokens:
        raise ValueError(
            f"output_token_ids: {len(output_ids)} tokens leave nothing of max_tokens {max_tokens}"
        )


def expand_forks(
    sampled: list[Sequence], requests: dict[str, Request], block_manager: BlockManager, scheduler: Scheduler
) -> tuple[list[int], list[Sequence]]:
    """Fork n-1 siblings off each prompt that just finished prefill (they share its blocks); all
    sample from its logits row. Returns the logits row of every sequence to sample, and them."""
    rows, seqs = [], []
    for row, seq in enumerate(sampled):
        rows.append(row)
        seqs.append(seq)
        request = requests[seq.request_id]
        if request.search is None and seq.num_output_tokens == 0 and len(request.seqs) < seq.params.n:
            for index in range(1, seq.params.n):
                child = Sequence(
                    seq.request_id,
                    list(seq.token_ids),
                    seq.num_prompt_tokens,
                    seq.params,
                    index=index,
                    arrival_time=seq.arrival_time,
                    max_tokens=seq.max_tokens,
                )
                block_manager.fork(seq, child)
                scheduler.add_running(child)
                request.seqs.append(child)
                rows.append(row)
                seqs.append(child)
    return rows, seqs
