"""Speculative decoding with n-gram prompt lookup: propose, then let one forward pass verify.

Before each step the engine asks ``Speculator.propose`` for draft tokens of every running decode:
the tokens that followed the most recent earlier occurrence of the sequence's last n tokens
(n from ``MAX_NGRAM`` down to ``MIN_NGRAM``), in its prompt or its output. The scheduler runs a
drafted decode as 1 + k rows (the last token and the k drafts) under the same token budget as
everything else, and trims the drafts when the budget is short. Row j's logits give the token
after draft j, so the engine samples row 0 with the ordinary sampler and goes on to row j + 1
only while the token it drew equals draft j + 1: each step yields 1 to k + 1 tokens.

Drawing each position with the ordinary sampler and keeping the draft only when the draw equals
it is rejection sampling for a proposer that puts all its mass on one token (accepted with
probability p(draft); on rejection the draw is p without the draft, renormalised). So the output
has the target distribution exactly, greedy output is the non-speculative output token for
token, and a seeded request draws what it would without speculation (the sampler's seed is a
function of the position, engine/sampler.py), on every path.

What it costs: each draft row is one more row through the weights. On a CPU a decode step
reads every weight once whatever its rows, so at small batches a row costs a few percent of
the step, and past ``MAX_BATCH_ROWS`` rows the step is bound by compute and speculation no
longer pays: proposals then stop (``budget``). Per sequence, the draft length follows its
measured acceptance: the k-th draft is accepted with probability about a^k at acceptance rate
a, so drafts stop where a^k falls under ``MIN_DRAFT_PROB``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from engine.block_manager import BlockManager
from engine.sequence import Sequence

SPECULATIVE_METHODS = ("ngram",)
MAX_NGRAM = 3  # longest suffix looked up
MIN_NGRAM = 1  # shortest
MAX_BATCH_ROWS = 32  # decode rows plus drafts in one step, past which no drafts are proposed
MIN_DRAFT_PROB = 0.3  # a draft is proposed while its estimated acceptance stays at or above this
EMA_WEIGHT = 0.3  # weight of the latest step in a sequence's acceptance rate


def ngram_lookup(tokens: np.ndarray, k: int, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last n tokens
    of ``tokens`` (longest n first); [] when no suffix recurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n :]
        # candidate starts i < length - n (not the suffix itself), each with a token after it
        match = tokens[: length - n] == tail[0]
        for j in range(1, n):
            match &= tokens[j : length - n + j] == tail[j]
        hits = np.flatnonzero(match)
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


@dataclasses.dataclass(slots=True)
class _SeqState:
    tokens: np.ndarray  # the sequence's token ids so far (a growing buffer)
    length: int = 0  # how much of ``tokens`` is filled
    acceptance: float = 1.0  # recent accepted drafts over proposed ones (starts optimistic)


@dataclasses.dataclass(slots=True)
class SpecStats:
    """Cumulative counts for a node's metrics: drafts proposed (and verified), drafts accepted."""

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    drafted_steps: int = 0  # sequence-steps that verified at least one draft

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Speculator:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens
        self.stats = SpecStats()
        self._states: dict[int, _SeqState] = {}

    def draft_length(self, seq: Sequence) -> int:
        """How many drafts ``seq`` may get now: its acceptance rate, its output limit (the last
        token is always drawn, never drafted) and the context limit."""
        state = self._states.get(seq.seq_id)
        a = 1.0 if state is None else state.acceptance
        k, prob = 0, 1.0
        while k < self.k and prob * a >= MIN_DRAFT_PROB:
            prob *= a
            k += 1
        return max(0, min(k, seq.max_tokens - seq.num_output_tokens - 1))

    def propose(self, running: list[Sequence], max_len: int) -> None:
        """Set ``draft_token_ids`` on the running decodes that may speculate; clear the rest."""
        decodes = [s for s in running if s.num_uncomputed_tokens == 1]
        spare = MAX_BATCH_ROWS - len(decodes)  # under load: no drafts at all
        for seq in running:
            seq.draft_token_ids = []
        for seq in decodes:
            if spare <= 0:
                break
            if seq.params.has_logits_rules or seq.hold_kv:  # a grammar's state moves a token at a time
                continue
            k = min(self.draft_length(seq), spare, max_len - seq.num_tokens)
            if k <= 0:
                continue
            seq.draft_token_ids = ngram_lookup(self._tokens(seq), k)
            spare -= len(seq.draft_token_ids)

    def verify(
        self,
        logits: torch.Tensor,
        drafted: list[tuple[Sequence, int]],
        sample: Callable[[torch.Tensor, list[Sequence]], None],
        block_manager: BlockManager,
    ) -> None:
        """Finish the step's drafted decodes, each with the token of its row 0 drawn already
        (``drafted``: the sequence and the index of that row in ``logits``). While the token drawn
        from row j equals draft j + 1, ``sample`` draws from row j + 1 (appending the token and
        checking the stop rules). Then the KV of the kept drafts counts as computed and the
        blocks past it go back to the pool."""
        checks = []  # (sequence, its drafts, its first row, its length before this step's tokens)
        for seq, first in drafted:
            checks.append((seq, seq.draft_token_ids, first, seq.num_tokens - 1))
            seq.draft_token_ids = []
        live, j = checks, 0
        while True:
            live = [
                c for c in live if not c[0].is_finished and j < len(c[1]) and c[0].token_ids[-1] == c[1][j]
            ]
            if not live:
                break
            j += 1
            rows = torch.tensor(
                [first + j for _, _, first, _ in live], dtype=torch.int64, device=logits.device
            )
            sample(logits[rows], [seq for seq, *_ in live])
        for seq, drafts, _, length in checks:
            self.verified(seq, len(drafts), seq.num_tokens - length - 1)
            if seq.is_finished:  # its blocks are freed (or held) already
                continue
            seq.num_computed_tokens = seq.num_tokens - 1  # the token drawn last has no KV yet
            block_manager.truncate(seq)
            block_manager.commit_computed(seq)

    def verified(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """Record one verification of ``proposed`` drafts, ``accepted`` of them kept."""
        self.stats.proposed_tokens += proposed
        self.stats.accepted_tokens += accepted
        self.stats.drafted_steps += 1
        state = self._states.get(seq.seq_id)
        if state is not None:
            state.acceptance += EMA_WEIGHT * (accepted / proposed - state.acceptance)

    def forget(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """``seq.token_ids`` as an array, appended to rather than rebuilt each step."""
        state = self._states.get(seq.seq_id)
        n = seq.num_tokens
        if state is None or state.length > n:  # new, or shorter (recomputed after a resume)
            capacity = max(64, 2 * n)
            state = _SeqState(np.empty(capacity, np.int64), 0, 1.0 if state is None else state.acceptance)
            self._states[seq.seq_id] = state
        if n > len(state.tokens):
            grown = np.empty(2 * n, np.int64)
            grown[: state.length] = state.tokens[: state.length]
            state.tokens = grown
        if state.length < n:
            state.tokens[state.length : n] = seq.token_ids[state.length : n]
            state.length = n
        return state.tokens[:n]
