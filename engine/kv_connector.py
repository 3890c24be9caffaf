"""What a node's KV transfer asks of its engine, on the scheduler's side (vLLM v1's scheduler-side
KV connector is the model): requests whose prompt KV another node computes, and requests whose KV
this node computed for another. It keeps that surface out of ``LLMEngine``'s own API (add, step,
abort, stats); the requests, their blocks and their states stay the engine's scheduler's.

    inbound (a decode node):   reserve ─► WAITING_FOR_KV in the waiting FIFO ─► a step grants its
                               blocks ─► on_granted callback ─► kv_arrived(first token) ─► RUNNING
    outbound (a prefill node): add_request(prefill_only=True) ─► first token ─► HELD_FOR_TRANSFER
                               ─► held / note_first_token_sent ─► release (blocks stay cached)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.requests import RemoteReservation, Request
from pdserve.engine.sequence import BeamCandidates, Sequence, SequenceStatus, TokenLogprob
from pdserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine


class KVConnector:
    """One engine's transfer surface. It holds nothing but the grant callback: every request it
    queues is the engine's, in the engine's scheduler."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._on_granted: Callable[[RemoteReservation], None] | None = None

    # ------------------------------------------------------------------ inbound (decode side)
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue a request whose prompt KV another node computes: WAITING_FOR_KV in the waiting FIFO
        with local prompts. A later ``step`` grants it blocks, prefix-cache hits included, by the
        rules local prompts are admitted by (``max_num_seqs``, free blocks above the watermark, no
        overtaking), and hands them to the ``on_granted`` callback before it computes. Returns its
        place in the queue. ValueError when it can never be admitted; QueueFullError while the
        queue is full."""
        if self._on_granted is None:
            raise RuntimeError("reserve needs an on_granted callback to hand grants to")
        if params.n != 1 and params.beam_search is None:
            raise ValueError("n: requests prefilled elsewhere take n == 1")
        engine = self._engine
        max_tokens = engine.admit(request_id, prompt_token_ids, params)
        params = dataclasses.replace(params, prompt_logprobs=None)  # the node that ran the prompt sent them
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            len(prompt_token_ids),
            params,
            arrival_time=time.monotonic(),
            max_tokens=max_tokens,
        )
        search = engine.search_for(params)
        position = engine.queue(seq, remote=True)  # its adapter pinned, or waiting for a slot
        engine.requests[request_id] = Request(request_id, list(prompt_token_ids), params, [seq], search)
        return position

    def on_granted(self, callback: Callable[[RemoteReservation], None]) -> None:
        """``callback(reservation)`` runs inside ``step`` for each reserved request granted blocks,
        before the step computes (the KV receiver tells the sender where to write)."""
        self._on_granted = callback

    def granted(self, seqs: list[Sequence]) -> None:
        """The step's grants (the engine calls this from ``step``)."""
        engine = self._engine
        engine.kv_prefault.advance(engine.block_manager.high_water)  # the KV lands before any step
        on_granted = self._on_granted
        assert on_granted is not None, "reserve queues no request without the callback"
        for seq in seqs:
            on_granted(RemoteReservation.of(seq, engine.block_manager.block_size))

    def kv_arrived(
        self, request_id: str, first_token: int, first_logprob: TokenLogprob | None = None
    ) -> list[RequestOutput]:
        """The reserved request's prompt KV landed, with the first token the other node sampled
        (and its logprobs). It decodes from the next step; returns its output at once when that
        first token already ends it. A beam search's first step takes its candidates from those
        logprobs (the other node listed them all) in place of the token."""
        engine = self._engine
        request = engine.requests[request_id]
        seq = request.seqs[0]
        assert seq.status is SequenceStatus.WAITING_FOR_KV, f"{request_id} is {seq.status}"
        engine.scheduler.kv_arrived(seq)
        if request.search is not None:
            if first_logprob is None or len(first_logprob.top) < request.search.num_candidates:
                raise ValueError("a beam search's prompt came without its first step's candidates")
            seq.beam_candidates = BeamCandidates(
                tuple(t for t, _ in first_logprob.top), tuple(v for _, v in first_logprob.top)
            )
            engine.advance_beams(request)
            return [engine.output(request)] if request.finished else []
        engine.take_token(seq, first_token, first_logprob)
        return [engine.output(request)] if seq.is_finished else []

    # ------------------------------------------------------------------ outbound (prefill side)
    def held(self, request_id: str) -> Sequence | None:
        """The prefill-only request's sequence while it is HELD_FOR_TRANSFER (blocks, prompt)."""
        return self._engine.scheduler.held.get(request_id)

    def note_first_token_sent(self, request_id: str) -> None:
        """The held request's first token reached the router: it can no longer start elsewhere."""
        seq = self.held(request_id)
        if seq is not None:
            seq.first_token_sent = True

    def first_token_sent(self, request_id: str) -> bool:
        """Whether the held request's first token has left (False when it is not held)."""
        seq = self.held(request_id)
        return seq is not None and seq.first_token_sent

    def release(self, request_id: str) -> bool:
        """The held request's transfer ended (or will not start): free its blocks, which stay as
        prefix cache. False when it was not held."""
        return self._engine.scheduler.release(request_id)
