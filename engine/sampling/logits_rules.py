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

import contextlib
import dataclasses
import pathlib
import threading
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from pdserve.engine.core.sequence import Sequence
from pdserve.grammar import GrammarCompiler
from pdserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    import tokenizers  # imported where bad_words first need it


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
        self._compiler_lock = threading.Lock()  # warm_up may build it on another thread
        self._executor: llguidance.LLExecutor | None = None  # computes a batch's masks in parallel
        self._tokenizer: tokenizers.Tokenizer | None = None  # for bad_words
        self._states: dict[int, _SeqRules] = {}  # seq_id -> rules of a live sequence

    @property
    def compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.from_folder(
                    self._folder("guided decoding"), self._vocab_size, self._eos_token_ids
                )
            return self._compiler

    def warm_up(self) -> None:
        """Build the grammar tokenizer now (about half a second for a 49k vocabulary) rather than
        in the first guided request; nothing without a tokenizer.json."""
        with contextlib.suppress(ValueError, FileNotFoundError):
            self.compiler  # noqa: B018 (built on first access)

    def warm_up_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.warm_up, name="grammar-warm-up", daemon=True)
        thread.start()
        return thread

    def _folder(self, what: str) -> pathlib.Path:
        folder = pathlib.Path(self._model_dir) if self._model_dir else None
        if folder is None or not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{what} needs the model's tokenizer.json")
        return folder

    def check(self, params: SamplingParams) -> None:
        """ValueError naming the field when a request's rules cannot be applied here."""
        vocab = self._vocab_size
        if any(b.token_id >= vocab for b in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        if params.allowed_token_ids is not None and any(t >= vocab for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids: token ids must be in [0, {vocab})")
        if params.bad_words:
            self._bad_word_ids(params.bad_words)
        if params.guided_decoding is not None:
            try:
                self.compiler.check(params.guided_decoding)
            except ValueError as exc:
                raise ValueError(f"guided_decoding: {exc}") from None

    def forget(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def apply(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        """Edit ``logits`` in place on ``rows`` (one per sequence in ``seqs``)."""
        # logits: [S, V] float32; rows index into S
        states = [self._state(seq, logits.device) for seq in seqs]
        originals = {}  # row -> its logits before rules that may leave no token at all
        for row, seq, state in zip(rows, seqs, states, strict=True):
            if state.allowed is not None or state.bad_words:
                originals[row] = logits[row].clone()
            _apply_token_rules(logits[row], seq, state)
        guided = [(r, q, s) for r, q, s in zip(rows, seqs, states, strict=True) if s.matcher is not None]
        disallowed = {}
        if guided:
            index = torch.tensor([row for row, _, _ in guided], dtype=torch.int64, device=logits.device)
            masks = self._grammar_masks(guided).to(logits.device)  # [G, V]
            logits[index] = logits[index].masked_fill_(masks, float("-inf"))  # one gather, one scatter
            disallowed = {row: masks[i] for i, (row, _, _) in enumerate(guided)}
        for row, original in originals.items():
            if not bool(logits[row].isfinite().any()):
                # allowed_token_ids and bad_words left no token (the grammar's) to sample: drop them
                mask = disallowed.get(row)
                logits[row] = original if mask is None else original.masked_fill_(mask, float("-inf"))

    def _state(self, seq: Sequence, device: torch.device) -> _SeqRules:
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = self._new_state(seq, device)
        return state

    def _new_state(self, seq: Sequence, device: torch.device) -> _SeqRules:
        """The request's rules as tensors on the logits' device, made once per sequence."""
        params = seq.params
        matcher = None if params.guided_decoding is None else self.compiler.matcher(params.guided_decoding)
        bias_ids = bias_values = allowed = None
        if params.logit_bias:
            bias_ids = torch.tensor([b.token_id for b in params.logit_bias], dtype=torch.int64, device=device)
            bias_values = torch.tensor(
                [b.bias for b in params.logit_bias], dtype=torch.float32, device=device
            )
        if params.allowed_token_ids is not None:
            allowed = torch.zeros(self._vocab_size, dtype=torch.bool, device=device)
            allowed[list(params.allowed_token_ids)] = True
        bad_words = self._bad_word_ids(params.bad_words) if params.bad_words else ()
        return _SeqRules(matcher, 0, bad_words, bias_ids, bias_values, allowed)

    def _grammar_masks(self, guided: list[tuple[int, Sequence, _SeqRules]]) -> torch.Tensor:
        """[G, V] bool, True where a guided row's grammar refuses the token, after feeding each
        matcher the output tokens it has not seen."""
        words = (self._vocab_size + 31) // 32
        bitmask = np.empty((len(guided), words), dtype=np.int32)  # [G, W], bit k of word w: token 32w+k
        matchers: list[tuple[llguidance.LLMatcher, int]] = []
        for i, (_, seq, state) in enumerate(guided):
            assert state.matcher is not None  # only guided rows come here
            new = seq.output_token_ids[state.num_consumed :]
            if new:
                state.matcher.consume_tokens(new)  # on a refused token it stays in error: EOS only
                state.num_consumed += len(new)
            matchers.append((state.matcher, i))
        if self._executor is None:  # the masks in parallel, on the engine's threads
            self._executor = llguidance.LLExecutor(num_threads=torch.get_num_threads())
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, words * 4, len(guided))
        # little-endian words: byte 4w + k // 8, bit k % 8; numpy unpacks ~10x faster than torch shifts
        bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, : self._vocab_size]
        return torch.from_numpy(bits == 0)

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


def _apply_token_rules(x: torch.Tensor, seq: Sequence, state: _SeqRules) -> None:
    """logit_bias, allowed_token_ids and bad_words on one row, in place."""
    # x: [V] a view into the batch's logits
    if state.bias_ids is not None:
        assert state.bias_values is not None  # made with bias_ids
        x.index_add_(0, state.bias_ids, state.bias_values)
    if state.allowed is not None:
        x.masked_fill_(~state.allowed, float("-inf"))
    banned = _banned_by_bad_words(state.bad_words, seq.output_token_ids)
    if banned:
        x[banned] = float("-inf")


def _banned_by_bad_words(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens the output just produced."""
    banned = []
    for ids in bad_words:
        prefix = ids[:-1]
        if not prefix or (len(output) >= len(prefix) and tuple(output[-len(prefix) :]) == prefix):
            banned.append(ids[-1])
    return banned
