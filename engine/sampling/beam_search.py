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
from typing import TYPE_CHECKING

import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.sequence import Sequence, SequenceStatus, TokenLogprob
from pdserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.core.requests import Request
    from pdserve.engine.core.scheduler import Scheduler


@dataclasses.dataclass(frozen=True, slots=True)
class BeamCandidates:
    """A beam's next-token choices from its latest logits row: the most likely tokens and their
    log-probabilities, most likely first."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


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
        # per running beam (by seq_id): the summed log-probability of its output tokens, and its
        # next-token choices once its row is computed (until the step that uses them)
        self.scores: dict[int, float] = {}
        self.candidates: dict[int, BeamCandidates] = {}
        self.num_cached_tokens = 0  # the prompt's prefix-cache hit (every beam is a fork of it)

    def ready(self, beams: list[Sequence]) -> bool:
        """Every running beam's row is computed (a preempted one recomputes first)."""
        return not self.done and all(
            b.seq_id in self.candidates and b.num_uncomputed_tokens == 0 for b in beams
        )

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
        self.candidates.clear()
        return running

    def results(self, running: list[Sequence]) -> list[Hypothesis]:
        """The answer, best first: the finished beams, topped up from the running ones (best
        first) should fewer than ``width`` have finished (an aborted or cut-short search)."""
        score = lambda s: self.scores.get(s.seq_id, 0.0)  # noqa: E731
        spare = sorted(running, key=lambda s: -score(s))[: self.width - len(self.finished)]
        extra = [
            Hypothesis(
                score(s) / max(1, s.num_output_tokens) ** self.length_penalty,
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
            cands = self.candidates[beam.seq_id]
            score = self.scores.get(beam.seq_id, 0.0)
            for rank, (token, logprob) in enumerate(
                zip(cands.token_ids[: self.num_candidates], cands.logprobs, strict=False)
            ):
                entries.append((-(score + logprob), order, rank, beam, token, logprob))
        entries.sort(key=lambda e: e[:3])
        return [
            Extension(beam, token, -neg, self._logprob(self.candidates[beam.seq_id], token, logprob))
            for neg, _, _, beam, token, logprob in entries[: self.num_candidates]
        ]

    def _logprob(self, cands: BeamCandidates, token: int, logprob: float) -> TokenLogprob | None:
        if self.num_top is None:
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
    search: BeamSearch,
    beams: list[Sequence],
    extensions: list[Extension],
    block_manager: BlockManager,
    scheduler: Scheduler,
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
            taken[i] = _extend(search, child, ext)
        if exts:
            first, ext = exts[0]
            taken[first] = _extend(search, parent, ext)
    for parent in beams:
        if parent.seq_id not in by_parent:
            scheduler.finish(parent, SequenceStatus.FINISHED_ABORTED)
            search.scores.pop(parent.seq_id, None)
    return [taken[i] for i in range(len(extensions))]


def _extend(search: BeamSearch, seq: Sequence, ext: Extension) -> Sequence:
    seq.token_ids.append(ext.token_id)
    search.scores[seq.seq_id] = ext.score
    if ext.logprob is not None:
        seq.logprobs.append(ext.logprob)
    return seq


class BeamSearches:
    """What the engine asks of beam search, in three calls: a new request's search (``start``,
    or ``prompt_params`` where only its prompt runs here), each step's beam rows (``take_rows``),
    and the first step of a search whose prompt ran on another engine (``land``). Each search
    lives on its request (``Request.search``); its beams are the request's sequences."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len

    def start(self, params: SamplingParams) -> BeamSearch | None:
        """A new request's search; None when it is no beam search."""
        if params.beam_search is None:
            return None
        return BeamSearch(params, self.eos_token_ids, self.max_model_len)

    def prompt_params(self, params: SamplingParams) -> SamplingParams:
        """A beam-search prompt that runs here for another engine: its first token's logprobs list
        every candidate the search's first step needs (the other engine takes them from the KV
        transfer's first logprobs), and no token ends it here."""
        stop_ids = stop_ids_of(params, self.eos_token_ids)
        num_top = max(num_candidates(params, len(stop_ids)), params.logprobs or 0)
        return dataclasses.replace(
            params, n=1, beam_search=None, logprobs=num_top, ignore_eos=True, stop_token_ids=()
        )

    def take_rows(
        self, logits: torch.Tensor, seqs: list[Sequence], requests: dict[str, Request]
    ) -> tuple[torch.Tensor, list[Sequence], list[Request]]:
        """Beams' rows become their candidates, and each search whose running beams all have theirs
        takes its step. Returns the rows and sequences left to sample, and the beam requests
        touched (their output may have changed)."""
        # logits: [len(seqs), vocab]
        beam_rows = [r for r, s in enumerate(seqs) if requests[s.request_id].search is not None]
        if not beam_rows:
            return logits, seqs, []
        touched: dict[str, Request] = {}
        beams = [seqs[r] for r in beam_rows]
        searches = [requests[b.request_id].search for b in beams]
        num = max(
            max(s.num_candidates for s in searches if s is not None), *(b.params.logprobs or 0 for b in beams)
        )
        index = torch.tensor(beam_rows, dtype=torch.int64, device=logits.device)
        for beam, search, cands in zip(beams, searches, candidates_of(logits[index], num), strict=True):
            assert search is not None
            search.candidates[beam.seq_id] = cands
            touched[beam.request_id] = requests[beam.request_id]
        for request in touched.values():
            self._advance(request)
        taken = set(beam_rows)
        rest = [r for r in range(len(seqs)) if r not in taken]
        keep = torch.tensor(rest, dtype=torch.int64, device=logits.device)
        return logits[keep], [seqs[r] for r in rest], list(touched.values())

    def land(self, request: Request, first: TokenLogprob | None) -> None:
        """The search's prompt ran on another engine, which listed the first step's candidates as
        its first token's logprobs: the first step, from them. ValueError when too few came."""
        search = request.search
        assert search is not None
        if first is None or len(first.top) < search.num_candidates:
            raise ValueError("a beam search's prompt came without its first step's candidates")
        seq = request.seqs[0]
        search.candidates[seq.seq_id] = BeamCandidates(
            tuple(t for t, _ in first.top), tuple(v for _, v in first.top)
        )
        self._advance(request)

    def _advance(self, request: Request) -> None:
        """One step of the request's search once every running beam has its candidates; at its
        end the answer (the best finished beams) takes the beams' place."""
        search = request.search
        assert search is not None
        beams = request.seqs
        if not search.ready(beams):
            return
        if beams[0].num_output_tokens == 0:  # the prompt: its hit is every beam's
            search.num_cached_tokens = beams[0].num_cached_tokens
        extensions = search.advance(beams)
        request.seqs = fork_beams(search, beams, extensions, self.scheduler.block_manager, self.scheduler)
        if search.done:
            self._answer(request, search)

    def _answer(self, request: Request, search: BeamSearch) -> None:
        running = [s for s in request.seqs if not s.is_finished]
        answer = search.results(running)
        for seq in running:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        request.seqs = [
            Sequence(
                request.request_id,
                hyp.token_ids,
                len(request.prompt_token_ids),
                request.params,
                index=index,
                status=hyp.status,
                finish_status=hyp.status,
                logprobs=hyp.logprobs,
                num_cached_tokens=search.num_cached_tokens,
            )
            for index, hyp in enumerate(answer)
        ]
