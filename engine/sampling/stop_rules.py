"""When a sequence ends: EOS, stop tokens and stop strings (after ``min_tokens``), ``max_tokens``
and the model's context. One object per engine; it keeps each sequence's stop-string state
(detok.StopStrings, the router's rule too) until the sequence is forgotten."""

from __future__ import annotations

from pdserve.detok import StopStrings
from pdserve.engine.core.sequence import Sequence, SequenceStatus


class StopRules:
    def __init__(self, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer=None) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer  # stop strings need it (LLMEngine.validate refuses them without)
        self._stops: dict[int, StopStrings] = {}  # seq_id -> stop-string matching, where it has stops

    def banned(self, seq: Sequence) -> tuple[int, ...]:
        """Tokens the sampler must not draw yet: EOS and stop tokens before ``min_tokens``."""
        if seq.num_output_tokens >= seq.params.min_tokens:
            return ()
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        return tuple(eos) + seq.params.stop_token_ids

    def check(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        """How the sequence ends with ``token_id`` just appended; None when it goes on. Sets
        ``seq.stop_text``."""
        params = seq.params
        hit = bool(params.stop) and self._stop_string_hit(seq, token_id)
        if seq.num_output_tokens >= params.min_tokens and (
            (not params.ignore_eos and token_id in self.eos_token_ids)
            or token_id in params.stop_token_ids
            or hit
        ):
            return SequenceStatus.FINISHED_STOPPED
        at_context = seq.num_tokens >= self.max_model_len
        if seq.num_output_tokens >= seq.max_tokens or at_context:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def forget(self, seq: Sequence) -> None:
        self._stops.pop(seq.seq_id, None)

    def _stop_string_hit(self, seq: Sequence, token_id: int) -> bool:
        state = self._stops.get(seq.seq_id)
        if state is None:
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            state = self._stops[seq.seq_id] = StopStrings(
                self.tokenizer, prompt, seq.params.stop, seq.params.min_tokens
            )
        if state.add(token_id):
            seq.stop_text = state.matcher.matched
        return state.stopped
