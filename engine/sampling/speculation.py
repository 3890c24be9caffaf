"""Speculative decoding: propose draft tokens, then let one forward pass verify them.

Before each step the engine asks ``Speculator.propose`` for draft tokens of every running decode.
With ``--speculative ngram`` they are the tokens that followed the most recent earlier occurrence
of the sequence's last n tokens (n from ``MAX_NGRAM`` down to ``MIN_NGRAM``), in its prompt or its
output; with ``--speculative-model`` a draft model's greedy tokens (engine/sampling/draft_model.py). The
scheduler runs a drafted decode as 1 + k rows (the last token and the k drafts) under the same
token budget as everything else, and trims the drafts when the budget is short. Row j's logits
give the token after draft j, so the engine samples row 0 with the ordinary sampler and goes on
to row j + 1 only while the token it drew equals draft j + 1: each step yields 1 to k + 1 tokens.

Drawing each position with the ordinary sampler and keeping the draft only when the draw equals
it is rejection sampling for a proposer that puts all its mass on one token (accepted with
probability p(draft); on rejection the draw is p without the draft, renormalised). So the output
has the target distribution exactly, greedy output is the non-speculative output token for
token, and a seeded request draws what it would without speculation (the sampler's seed is a
function of the position, engine/sampling/sampler.py), on every path.

What it costs: each draft row is one more row through the weights. A decode step on a CPU takes
about W + c * rows: W for reading every weight once, whatever the rows, and c for each row's
arithmetic. ``RowCost`` fits W and c to the node's own decode steps as they run. Adding a draft
kept with probability p to a step that yields Y tokens in T seconds raises the step's tokens per
second exactly when p > c * Y / T, so drafts are handed out in order of their probability while
that holds: at small batches the step is all W and nearly any plausible draft pays; as the batch
grows, c * Y / T nears 1 and speculation turns itself off. Per sequence, a draft's probability
is a^k for the k-th draft at the sequence's measured per-token acceptance a. A draft model's
time counts in T (a step is timed from the proposal on), so its cost per draft lands in c.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pdserve.engine.sampling.draft_model import DraftModel

MAX_NGRAM = 3  # longest suffix looked up
MIN_NGRAM = 1  # shortest
MIN_DRAFT_PROB = 0.1  # never propose a draft less likely than this, however cheap rows are
EMA_WEIGHT = 0.3  # weight of the latest verification in a sequence's acceptance rate
PRIOR_ROWS_PER_STEP = 32  # before the fit: a row's arithmetic costs 1/32 of the weights' read
ROW_COST_DECAY = 0.99  # weight of an older decode step in the row-cost fit, per later step
MIN_FIT_STEPS = 16  # decode steps observed, with rows that vary, before the fit replaces the prior


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


class RowCost:
    """Decode steps' seconds as ``fixed + per_row * rows``: a least-squares fit over recent
    decode-only steps, older ones decaying, so it follows what the node's steps cost now."""

    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._steps = 0

    def observe(self, rows: int, seconds: float) -> None:
        d = ROW_COST_DECAY
        self._n = d * self._n + 1
        self._x = d * self._x + rows
        self._y = d * self._y + seconds
        self._xx = d * self._xx + rows * rows
        self._xy = d * self._xy + rows * seconds
        self._steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per row), or None until enough steps with varied rows."""
        var = self._xx / max(self._n, 1e-9) - (self._x / max(self._n, 1e-9)) ** 2
        if self._steps < MIN_FIT_STEPS or var < 1.0:
            return None
        per_row = (self._xy - self._x * self._y / self._n) / (self._xx - self._x * self._x / self._n)
        fixed = (self._y - per_row * self._x) / self._n
        return max(fixed, 0.0), max(per_row, 0.0)


@dataclasses.dataclass(slots=True)
class _SeqState:
    tokens: np.ndarray  # the sequence's token ids so far (a growing buffer)
    length: int = 0  # how much of ``tokens`` is filled


@dataclasses.dataclass(slots=True)
class SpecStats:
    """Cumulative counts for a node's metrics: drafts proposed (and verified), drafts accepted."""

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    drafted_steps: int = 0  # sequence-steps that verified at least one draft

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Speculator:
    """Drafts by n-gram lookup, or from ``draft`` (a draft model) where one is given."""

    def __init__(self, num_speculative_tokens: int, draft: DraftModel | None = None) -> None:
        self.k = num_speculative_tokens
        self.draft = draft
        self.stats = SpecStats()
        self.row_cost = RowCost()
        self.acceptance = 1.0  # the node's per-token acceptance, where new sequences start
        self._states: dict[int, _SeqState] = {}  # seq_id -> its tokens, for the n-gram lookup
        self._acceptance: dict[int, float] = {}  # seq_id -> its per-token acceptance, once verified

    def acceptance_of(self, seq: Sequence) -> float:
        return self._acceptance.get(seq.seq_id, self.acceptance)

    def draft_length(self, seq: Sequence, threshold: float = MIN_DRAFT_PROB) -> int:
        """How many drafts ``seq`` may get while each is kept with probability at least
        ``threshold``, within its output limit (the last token is always drawn, never drafted)."""
        a = self.acceptance_of(seq)
        k, prob = 0, 1.0
        while k < self.k and prob * a >= max(threshold, MIN_DRAFT_PROB):
            prob *= a
            k += 1
        return max(0, min(k, seq.max_tokens - seq.num_output_tokens - 1))

    def budget(self, num_decodes: int, drafts: list[tuple[Sequence, int]]) -> dict[int, int]:
        """How many of its drafts (``drafts``: each sequence and how many it has) each keeps for
        this step, of ``num_decodes``: the
        drafts in order of their probability, each taken while it exceeds c * Y / T (the module's
        docstring), Y and T growing with each taken."""
        fitted = self.row_cost.fit()
        fixed, per_row = (PRIOR_ROWS_PER_STEP, 1.0) if fitted is None else fitted
        tokens, seconds = float(num_decodes), fixed + per_row * num_decodes
        candidates = []  # (probability, seq_id)
        for seq, num_drafts in drafts:
            a, prob = self.acceptance_of(seq), 1.0
            for _ in range(num_drafts):
                prob *= a
                candidates.append((prob, seq.seq_id))
        candidates.sort(key=lambda c: c[0], reverse=True)
        counts: dict[int, int] = {}
        for prob, seq_id in candidates:
            if prob * seconds <= per_row * tokens:
                break
            counts[seq_id] = counts.get(seq_id, 0) + 1
            tokens += prob
            seconds += per_row
        return counts

    def propose(self, running: list[Sequence], waiting: Iterable[Sequence], max_len: int) -> None:
        """Set ``draft_token_ids`` on the running decodes that may speculate; clear the rest.
        None while prompt tokens wait (a queued local prompt, or a running prompt's next chunk):
        drafts would take the step's token budget from them and lengthen their TTFT, and the
        cost model, fitted to decode steps, does not price a mixed step."""
        for seq in running:
            seq.draft_token_ids = []
        if any(s.num_uncomputed_tokens > 1 for s in running) or any(
            s.status is SequenceStatus.WAITING for s in waiting
        ):
            return
        num_decodes, wanted = 0, []  # wanted: (sequence, most drafts it may get)
        for seq in running:
            if seq.num_uncomputed_tokens != 1:
                continue
            num_decodes += 1
            # a grammar's state moves a token at a time; beams fork every step (engine/sampling/beam_search.py)
            if seq.params.has_logits_rules or seq.params.beam_search is not None:
                continue
            # no draft past the context or the last token it may still generate (a sent prompt's
            # sequence stops at its first)
            k = min(
                self.draft_length(seq), max_len - seq.num_tokens, seq.max_tokens - seq.num_output_tokens - 1
            )
            if k > 0:
                wanted.append((seq, k))
        if self.draft is None:  # a lookup is free: find the drafts, then price them
            drafts = [(seq, found) for seq, k in wanted if (found := ngram_lookup(self._tokens(seq), k))]
            counts = self.budget(num_decodes, [(seq, len(found)) for seq, found in drafts])
        else:  # a draft model's tokens cost a pass each: price the drafts first (by position
            # alone), then run it for the ones that pay
            counts = self.budget(num_decodes, wanted)
            proposed = self.draft.propose(
                [(seq, counts[seq.seq_id]) for seq, _ in wanted if seq.seq_id in counts]
            )
            drafts = [(seq, proposed[seq.seq_id]) for seq, _ in wanted if seq.seq_id in proposed]
        for seq, tokens in drafts:
            seq.draft_token_ids = tokens[: counts.get(seq.seq_id, 0)]

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode-only step of ``rows`` rows (drafts included) took ``seconds``."""
        self.row_cost.observe(rows, seconds)

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
            if seq.is_finished:  # at its row 0 (a stop token): its drafts were never tried
                continue
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
        # per-token acceptance: each kept draft a success, the first rejected one (if any) a
        # failure; the drafts after it were never tried
        assert 0 <= accepted <= proposed and proposed > 0, (accepted, proposed)
        rate = accepted / (accepted + (accepted < proposed))
        own = self.acceptance_of(seq)  # a sequence starts from the node's rate
        self._acceptance[seq.seq_id] = own + EMA_WEIGHT * (rate - own)
        self.acceptance += EMA_WEIGHT * (rate - self.acceptance)

    def forget(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)
        self._acceptance.pop(seq.seq_id, None)

    def _tokens(self, seq: Sequence) -> np.ndarray:
        """``seq.token_ids`` as an array, appended to rather than rebuilt each step."""
        state = self._states.get(seq.seq_id)
        n = seq.num_tokens
        if state is None or state.length > n:  # new, or shorter (recomputed after a resume)
            capacity = max(64, 2 * n)
            state = _SeqState(np.empty(capacity, np.int64), 0)
            self._states[seq.seq_id] = state
        if n > len(state.tokens):
            grown = np.empty(2 * n, np.int64)
            grown[: state.length] = state.tokens[: state.length]
            state.tokens = grown
        if state.length < n:
            state.tokens[state.length : n] = seq.token_ids[state.length : n]
            state.length = n
        return state.tokens[:n]
