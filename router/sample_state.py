"""One sample's output as its chunks arrive: text deltas, stop strings, logprobs, token counts."""

from __future__ import annotations

import dataclasses

from pdserve.detok import StopStrings
from pdserve.protocol import messages as pm
from pdserve.protocol.reasons import FinishReason
from pdserve.router.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class SampleDelta:
    """What a chunk adds to a sample's output."""

    text: str  # safe to send (never part of a stop string)
    logprobs: tuple[pm.TokenLogprobs, ...]  # of the tokens this chunk contributed, when asked for
    finish_reason: FinishReason | None  # set on the sample's last delta
    token_ids: tuple[int, ...] = ()  # the tokens this chunk contributed (up to a stop string)


class SampleState:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: tuple[int, ...],
        stop: tuple[str, ...],
        no_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._stops = StopStrings(tokenizer, list(prompt_ids), stop, min_tokens)  # the engine's rule too
        self._no_output = no_output  # max_tokens 0: the node's one token is not the client's
        self.num_prompt_tokens = len(prompt_ids)  # replaced by the node's count
        self.num_cached_tokens = 0  # prompt tokens from a prefix cache (the first chunk says)
        self.num_output_tokens = 0  # generated tokens that count (up to a stop string)
        self.output_token_ids: list[int] = []  # those tokens
        self.prompt_logprobs: tuple[pm.TokenLogprobs, ...] | None = None  # from the first chunk with them
        self.finish_reason: FinishReason | None = None

    @property
    def text(self) -> str:
        return self._stops.matcher.text

    @property
    def stop_string(self) -> str | None:
        """The stop string the output ended at (None: it did not end at one)."""
        return self._stops.matcher.matched if self._stops.matcher.stopped else None

    def on_chunk(self, chunk: pm.TokenChunk) -> SampleDelta:
        assert self.finish_reason is None, "chunk after the sample finished"
        if chunk.is_first or self.num_output_tokens == 0:
            self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
            self.num_cached_tokens = chunk.num_cached_tokens
        if chunk.prompt_logprobs and self.prompt_logprobs is None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if self._no_output:
            self.finish_reason = FinishReason.LENGTH if chunk.finish_reason is not None else None
            return SampleDelta("", (), self.finish_reason)
        logprobs, token_ids = [], []
        for i, token_id in enumerate(chunk.token_ids):
            self.num_output_tokens += 1
            token_ids.append(token_id)
            if i < len(chunk.logprobs):
                logprobs.append(chunk.logprobs[i])
            if self._stops.add(token_id):
                self.finish_reason = FinishReason.STOP
                break
        if self.finish_reason is None and chunk.finish_reason is not None:
            self.finish_reason = FinishReason.STOP if self._stops.finish() else chunk.finish_reason
        self.output_token_ids += token_ids
        text = self._stops.matcher.take(final=self.finish_reason is not None)
        return SampleDelta(text, tuple(logprobs), self.finish_reason, tuple(token_ids))
