"""Per-request edits of the logits before sampling: logit_bias, allowed_token_ids, bad_words and
the guided-decoding grammar's token mask. Only rows whose params ask for one are touched, so an
unconstrained row in the same batch costs nothing here.

A sequence's grammar matcher is built on its first constrained step and fed every output token
it has not seen yet before each mask: the token the sampler just picked, and also tokens that
came from elsewhere (a decode node adopts a sequence with the prefill node's first token
appended). So the matcher's state is a function of the output tokens alone, and a sequence that
moves between engines is constrained exactly as one engine would have.
"""

from __future__ import annotations

import dataclasses
import pathlib

import llguidance
import torch

from engine.guided import GrammarCompiler
from engine.sequence import Sequence


@dataclasses.dataclass(slots=True)
class _SeqRules:
    matcher: llguidance.LLMatcher | None  # None: no grammar
    num_consumed: int  # output tokens fed to the matcher so far
    bad_words: tuple[tuple[int, ...], ...]  # token sequences that may not be completed
    bias_ids: torch.Tensor | None  # [K] int64, logit_bias token ids
    bias_values: torch.Tensor | None  # [K] float32
    allowed: torch.Tensor | None  # [V] bool, allowed_token_ids as a mask


class LogitsRules:
    """Applies each sequence's rules to its logits row; state per sequence until ``forget``."""

    def __init__(self, model_dir: str | None, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._model_dir = model_dir  # its tokenizer.json, read on the first request that needs it
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._compiler: GrammarCompiler | None = None
        self._tokenizer = None  # tokenizers.Tokenizer, for bad_words
        self._states: dict[int, _SeqRules] = {}  # seq_id -> rules of a live sequence

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler.from_folder(
                self._folder("guided decoding"), self._vocab_size, self._eos_token_ids
            )
        return self._compiler

    def _folder(self, what: str) -> pathlib.Path:
        folder = pathlib.Path(self._model_dir) if self._model_dir else None
        if folder is None or not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{what} needs the model's tokenizer.json")
        return folder

    def check(self, seq_params) -> None:
        """ValueError naming the field when a request's rules cannot be applied here."""
        vocab = self._vocab_size
        ids = [b.token_id for b in seq_params.logit_bias]
        if any(t >= vocab for t in ids):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if seq_params.allowed_token_ids is not None and any(t >= vocab for t in seq_params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids: token ids must be in [0, {vocab})")
        if seq_params.bad_words:
            self._bad_word_ids(seq_params.bad_words)
        if seq_params.guided_decoding is not None:
            try:
                self.compiler.check(seq_params.guided_decoding)
            except ValueError as exc:
                raise ValueError(f"guided_decoding: {exc}") from None

    def forget(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def apply(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        """Edit ``logits`` in place on ``rows`` (one per sequence in ``seqs``)."""
        # logits: [S, V] float32; rows index into S
        states = [self._state(seq) for seq in seqs]
        guided = [(r, s) for r, s in zip(rows, states, strict=True) if s.matcher is not None]
        allowed = self._grammar_masks(guided, seqs, rows) if guided else {}
        for row, seq, state in zip(rows, seqs, states, strict=True):
            x = logits[row]  # [V], a view: the edits land in logits
            mask = allowed.get(row)
            can_empty = state.allowed is not None or bool(state.bad_words)
            original = x.clone() if can_empty else None
            if state.bias_ids is not None:
                x.index_add_(0, state.bias_ids, state.bias_values)
            if state.allowed is not None:
                x.masked_fill_(~state.allowed, float("-inf"))
            banned = _banned_by_bad_words(state.bad_words, seq.output_token_ids)
            if banned:
                x[banned] = float("-inf")
            if mask is not None:
                x.masked_fill_(~mask, float("-inf"))
            if original is not None and not bool(x.isfinite().any()):
                # allowed_token_ids and bad_words left no token (the grammar's) to sample: drop them
                x.copy_(original if mask is None else original.masked_fill_(~mask, float("-inf")))

    def _state(self, seq: Sequence) -> _SeqRules:
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = self._new_state(seq)
        return state

    def _new_state(self, seq: Sequence) -> _SeqRules:
        params = seq.params
        matcher = None if params.guided_decoding is None else self.compiler.matcher(params.guided_decoding)
        bias_ids = bias_values = allowed = None
        if params.logit_bias:
            bias_ids = torch.tensor([b.token_id for b in params.logit_bias], dtype=torch.int64)
            bias_values = torch.tensor([b.bias for b in params.logit_bias], dtype=torch.float32)
        if params.allowed_token_ids is not None:
            allowed = torch.zeros(self._vocab_size, dtype=torch.bool)
            allowed[list(params.allowed_token_ids)] = True
        bad_words = self._bad_word_ids(params.bad_words) if params.bad_words else ()
        return _SeqRules(matcher, 0, bad_words, bias_ids, bias_values, allowed)

    def _grammar_masks(
        self, guided: list[tuple[int, _SeqRules]], seqs: list[Sequence], rows: list[int]
    ) -> dict[int, torch.Tensor]:
        """Each guided row's allowed tokens, after feeding its matcher the tokens it lacks."""
        seq_of_row = dict(zip(rows, seqs, strict=True))
        words = (self._vocab_size + 31) // 32
        bitmask = torch.empty(len(guided), words, dtype=torch.int32)  # [G, W] one bit per token
        for i, (row, state) in enumerate(guided):
            new = seq_of_row[row].output_token_ids[state.num_consumed :]
            if new:
                state.matcher.consume_tokens(new)  # on a refused token it stays in error: EOS only
                state.num_consumed += len(new)
            state.matcher.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), words * 4)
        bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [G, W, 32]
        allowed = bits.view(len(guided), words * 32)[:, : self._vocab_size].bool()  # [G, V]
        return {row: allowed[i] for i, (row, _) in enumerate(guided)}

    def _bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's tokens, alone and after a space (as a word inside text), as vLLM does."""
        if self._tokenizer is None:
            import tokenizers

            folder = self._folder("bad_words")
            self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        out: list[tuple[int, ...]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self._tokenizer.encode(text, add_special_tokens=False).ids)
                if ids and ids not in out:
                    out.append(ids)
        return tuple(out)


def _banned_by_bad_words(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens the output just produced."""
    banned = []
    for ids in bad_words:
        prefix = ids[:-1]
        if not prefix or (len(output) >= len(prefix) and tuple(output[-len(prefix) :]) == prefix):
            banned.append(ids[-1])
    return banned
