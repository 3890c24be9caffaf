"""Beam search (``SamplingParams.beam_search``), scored as Hugging Face's ``generate(num_beams=n)``.

A request's n beams are sequences of the engine's scheduler like any other: they run as decode
rows of the same steps as everyone else's and share their blocks copy-on-write, forked off one
another with the block manager's ref counts. One step of the search, once every running beam's
row is computed:

    beams' rows ─► log_softmax, top M each ─► BeamCandidates on each beam
    all beams' candidates, by summed log-probability ─► the best K (K = max(2, 1 + stop tokens) x n)
        ├─ the best n that do not end ─► the next beams: a parent with c children keeps the first
        │                                and forks c - 1 (they share its blocks); one with none is dropped
        └─ those among the first n that end (a stop token, max_tokens, the context) ─► finished,
           scored sum / length ** length_penalty; the best n finished are kept

The search ends when n beams have finished and ``early_stopping`` is set, when no running beam can
beat the worst finished one at its present length (Hugging Face's heuristic), or when every
candidate ends. The answer is the finished beams, best first.

Beams advance together: a beam whose row is computed while a sibling was preempted keeps its
candidates and waits (the scheduler runs it no more: nothing of it is uncomputed) until the
sibling's row comes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import BeamCandidates, Sequence, SequenceStatus, TokenLogprob
from pdserve.protocol.sampling_params import SamplingParams


@dataclasses.dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    score: float  # summed log-probability / generated tokens ** length_penalty
    token_ids: list[int]  # prompt and output
    logprobs: list[TokenLogprob]  # per output token, when asked for
    status: SequenceStatus  # FINISHED_STOPPED (a stop token) or FINISHED_LENGTH


@dataclasses.dataclass(frozen=True, slots=True)
class Extension:
    """A running beam's next token, chosen this step."""

    parent: Sequence
    token_id: int
    score: float  # the parent's summed log-probability and this token's
    logprob: TokenLogprob | None  # what the beam reports for the token (None: not asked)


def num_candidates(params: SamplingParams, num_stop_ids: int) -> int:
    """Hugging Face's candidates kept per step: enough that n survive however many end."""
    return max(2, 1 + num_stop_ids) * params.n


def stop_ids_of(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return frozenset((*eos, *params.stop_token_ids))


def candidates_of(logits: torch.Tensor, num: int) -> list[BeamCandidates]:
    """Each row's ``num`` most likely tokens under its log_softmax, most likely first."""
    # logits: [B, vocab] float32
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = torch.topk(logprobs, min(num, logits.shape[-1]), dim=-1)  # [B, num], descending
    return [BeamCandidates(tuple(i), tuple(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


class BeamSearch:
    """One request's search: the finished beams so far and whether it is over. The running
    beams are the request's sequences."""

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        assert params.beam_search is not None
        self.width = params.n
        self.length_penalty = params.beam_search.length_penalty
        self.early_stopping = params.beam_search.early_stopping
        self.num_top = params.logprobs  # alternatives each token reports; None: no logprobs
        self.stop_ids = stop_ids_of(params, eos_token_ids)
        self.num_candidates = num_candidates(params, len(self.stop_ids))
        self.max_model_len = max_model_len
        self.finished: list[Hypothesis] = []  # best first, at most width
        self.improvable = True  # a running beam may still beat the worst finished one
        self.done = False

    def advance(self, beams: list[Sequence]) -> list[Extension]:
        """One step over the running beams (each with its candidates): their next tokens, best
        first, at most ``width``; the beams that end go to ``finished``."""
        ranked = self._ranked(beams)
        running: list[Extension] = []
        ended: list[Hypothesis] = []
        for rank, ext in enumerate(ranked):
            status = self._ends(ext)
            if status is None:
                if len(running) < self.width:
                    running.append(ext)
            elif rank < self.width:  # the rest only stand by so that ``width`` beams go on
                ended.append(self._hypothesis(ext, status))
        if self.improvable and not (self.early_stopping and self._full):
            # stable: an older hypothesis stays ahead of a new one with the same score
            self.finished = sorted([*self.finished, *ended], key=lambda h: -h.score)[: self.width]
        if running and self._full:
            best = running[0].score / self._generated(running[0]) ** self.length_penalty
            self.improvable &= best > self.finished[-1].score
        every_one_ends = len(running) == 0
        self.done = not self.improvable or (self.early_stopping and self._full) or every_one_ends
        for beam in beams:
            beam.beam_candidates = None
        return running

    def results(self, running: list[Sequence]) -> list[Hypothesis]:
        """The answer, best first: the finished beams, topped up from the running ones (best
        first) should fewer than ``width`` have finished (an aborted or cut-short search)."""
        spare = sorted(running, key=lambda s: -s.beam_score)[: self.width - len(self.finished)]
        extra = [
            Hypothesis(
                s.beam_score / max(1, s.num_output_tokens) ** self.length_penalty,
                list(s.token_ids),
                list(s.logprobs),
                SequenceStatus.FINISHED_LENGTH,
            )
            for s in spare
        ]
        return [*self.finished, *extra]

    @property
    def _full(self) -> bool:
        return len(self.finished) == self.width

    def _ranked(self, beams: list[Sequence]) -> list[Extension]:
        """The best ``num_candidates`` extensions of all beams, by summed log-probability; ties in
        beam order, then the token's rank in its row (a flattened top-k's order)."""
        entries = []
        for order, beam in enumerate(beams):
            cands = beam.beam_candidates
            assert cands is not None, "a beam advanced without its row"
            for rank, (token, logprob) in enumerate(
                zip(cands.token_ids[: self.num_candidates], cands.logprobs, strict=False)
            ):
                entries.append((-(beam.beam_score + logprob), order, rank, beam, token, logprob))
        entries.sort(key=lambda e: e[:3])
        return [
            Extension(beam, token, -neg, self._logprob(beam.beam_candidates, token, logprob))
            for neg, _, _, beam, token, logprob in entries[: self.num_candidates]
        ]

    def _logprob(self, cands: BeamCandidates | None, token: int, logprob: float) -> TokenLogprob | None:
        if self.num_top is None or cands is None:
            return None
        top = tuple(zip(cands.token_ids[: self.num_top], cands.logprobs[: self.num_top], strict=True))
        return TokenLogprob(token, logprob, top)

    def _ends(self, ext: Extension) -> SequenceStatus | None:
        parent = ext.parent
        if ext.token_id in self.stop_ids:
            return SequenceStatus.FINISHED_STOPPED
        if parent.num_output_tokens + 1 >= parent.max_tokens or parent.num_tokens + 1 >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _generated(self, ext: Extension) -> int:
        return ext.parent.num_output_tokens + 1

    def _hypothesis(self, ext: Extension, status: SequenceStatus) -> Hypothesis:
        parent = ext.parent
        logprobs = [*parent.logprobs, ext.logprob] if ext.logprob is not None else []
        return Hypothesis(
            ext.score / self._generated(ext) ** self.length_penalty,
            [*parent.token_ids, ext.token_id],
            logprobs,
            status,
        )


def fork_beams(
    beams: list[Sequence], extensions: list[Extension], block_manager: BlockManager, scheduler: Scheduler
) -> list[Sequence]:
    """Turn the running beams into the next ones: a parent keeps its first extension and forks
    one sequence per further one (sharing its blocks); a parent with none is dropped (its blocks
    go back, those its children share aside). Returns the new beams, best first."""
    by_parent: dict[int, list[tuple[int, Extension]]] = {}  # parent -> (position, extension), best first
    for i, ext in enumerate(extensions):
        by_parent.setdefault(ext.parent.seq_id, []).append((i, ext))
    taken: dict[int, Sequence] = {}  # the extension's position -> the sequence that takes it
    for parent in beams:
        exts = by_parent.get(parent.seq_id, [])
        for i, ext in exts[1:]:  # forks first: the parent is still as its children start from
            child = Sequence(
                parent.request_id,
                list(parent.token_ids),
                parent.num_prompt_tokens,
                parent.params,
                arrival_time=parent.arrival_time,
                max_tokens=parent.max_tokens,
                logprobs=list(parent.logprobs),
                first_scheduled_time=parent.first_scheduled_time,
            )
            block_manager.fork(parent, child)
            scheduler.add_running(child)
            taken[i] = _extend(child, ext)
        if exts:
            first, ext = exts[0]
            taken[first] = _extend(parent, ext)
    for parent in beams:
        if parent.seq_id not in by_parent:
            scheduler.finish(parent, SequenceStatus.FINISHED_ABORTED)
    return [taken[i] for i in range(len(extensions))]


def _extend(seq: Sequence, ext: Extension) -> Sequence:
    seq.token_ids.append(ext.token_id)
    seq.beam_score = ext.score
    if ext.logprob is not None:
        seq.logprobs.append(ext.logprob)
    return seq
