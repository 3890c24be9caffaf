"""Iteration-level scheduler with one code path for prefill, chunked prefill and decode.

Every sequence carries ``num_computed_tokens``; each step hands out ``num_new_tokens`` per
sequence under a token budget, so a decode is 1 new token, a prompt chunk is many, and a
prefix hit simply starts with tokens already computed. Order of service:

  1. running sequences, oldest first (decodes and unfinished prompt chunks); a chunk leaves
     one token of the budget to each running decode after it, so every decode row runs every
     step however long the prompts beside it; when blocks run out, the newest running sequence is preempted (KV dropped,
     recomputed later) — the oldest always progresses, so there is no livelock;
     A decode with speculative drafts (engine/sampling/speculation.py) runs them as more rows in the
     same budget, trimmed first when the budget or the free blocks fall short;
  2. waiting sequences, FIFO, while budget, ``max_num_seqs`` and free blocks allow;
     the head of the queue is never skipped, so nothing starves.

The scheduler owns the node's KV connector (engine/core/kv_connector.py) and asks it three things: how
many of a waiting request's tokens a peer computes, to note the blocks it allocated for them, and
whether a finishing request's blocks stay held for a transfer. A decode node's requests whose
prompt KV comes from a prefill node wait in the same FIFO, WAITING_FOR_KV with no blocks; the loop
above grants them blocks by the same rules (head first, ``max_num_seqs``, free blocks above the
watermark) but no token budget, since this node computes none of their prompt. Granted, they are
``receiving``: they hold their blocks and a slot like running ones, and join ``running`` once
their KV has landed (``kv_arrived``). A prefill node's prompt-only sequences end held
(HELD_FOR_TRANSFER, the connector's ``held``): out of the batch, blocks kept for the KV transfer,
until ``release``.

Two per-request rules are consulted in the waiting loop, one call each: a request's adapter must
hold a LoRA slot (``SlotAdmission``, one FIFO for everyone: a request whose adapter has none is
passed by those behind it), and the beams of a beam search come back together (``_gang_fits``).

    WAITING ──schedule──► RUNNING ──finish──► FINISHED_*     (blocks freed)
       ▲                   │   └──finish (connector: held)──► HELD_FOR_TRANSFER ──release──► FINISHED_*
       └────preempt────────┘
    add (a received prompt) ──► WAITING_FOR_KV ──schedule (granted)──► receiving ──kv_arrived──► RUNNING
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Collection
from typing import Protocol

from pdserve.engine.core.block_manager import BlockCopy, BlockManager
from pdserve.engine.core.kv_connector import KVConnector, hit_limit
from pdserve.engine.core.sequence import Sequence, SequenceStatus


class SlotAdmission(Protocol):
    """A per-request admission rule beside blocks and slots (the LoRA adapters' slots:
    engine/lora/registry.py)."""

    def admit(self, seq: Sequence, may_load: bool) -> bool:
        """Whether ``seq`` may enter a step now (taking what it needs, once per request);
        ``may_load``: it may take a resource nobody holds yet (False once an earlier request
        waits for one, so that none overtakes it). ValueError when it never can."""
        ...

    def check_integrity(self, live_request_ids: Collection[str]) -> None:
        """Assert that only requests still in the scheduler hold what ``admit`` gave them."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to run through the model this step


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # in batch order: decodes first, then prefill chunks
    block_copies: list[BlockCopy]  # copy-on-write to do before the forward pass
    preempted: list[Sequence]  # dropped back to WAITING this step
    granted: list[Sequence] = dataclasses.field(default_factory=list)  # WAITING_FOR_KV, blocks now held
    # left the waiting queue for good: admission refused them (their adapter cannot be read), with why
    refused: list[tuple[Sequence, str]] = dataclasses.field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        connector: KVConnector | None = None,
        admission: SlotAdmission | None = None,
    ) -> None:
        """``connector``: the node's transfers (None: this engine transfers nothing);
        ``admission``: the LoRA slots (None: LoRA is off)."""
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.connector = connector or KVConnector(block_manager.block_size, block_manager.num_blocks)
        self.admission = admission
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.receiving: list[Sequence] = []  # WAITING_FOR_KV: blocks held, KV arriving from a peer
        # The last schedule found nothing to run or grant, and nothing has changed since: the
        # waiting head cannot be admitted until something ends (has_work says no meanwhile).
        self._stalled = False

    @property
    def held(self) -> dict[str, Sequence]:
        """HELD_FOR_TRANSFER sequences by request id (a prefill node's; the connector keeps them)."""
        return self.connector.held

    def add(self, seq: Sequence) -> None:
        """A new sequence into the waiting FIFO: WAITING, or WAITING_FOR_KV with no blocks when a
        peer computes its prompt (the connector says), until ``schedule`` grants them."""
        remote = self.connector.num_remote_tokens(seq) > 0
        seq.status = SequenceStatus.WAITING_FOR_KV if remote else SequenceStatus.WAITING
        self.waiting.append(seq)
        self._stalled = False

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in place (a fork, or KV received from a prefill node)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self._stalled = False

    def has_work(self) -> bool:
        """Anything for the next ``schedule``: a sequence to run, or a waiting one (local prompt or
        grant) it may admit. Granted sequences whose KV is still arriving are not work."""
        return bool(self.running) or (bool(self.waiting) and not self._stalled)

    @property
    def num_seqs(self) -> int:
        """Sequences holding a slot under ``max_num_seqs``."""
        return len(self.running) + len(self.receiving)

    def _watermark(self) -> int:
        # Keep a few blocks back while others run, so admitting a prompt doesn't force the
        # running decodes to preempt it right away on their next block.
        return max(1, self.block_manager.num_blocks // 100) if self.running else 0

    def kv_arrived(self, seq: Sequence) -> None:
        """The reserved prompt's KV landed: its prompt is computed, it decodes from the next step."""
        self.receiving.remove(seq)
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit_computed(seq)
        self.add_running(seq)

    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        """This step's work, under ``budget`` tokens (at most ``max_num_batched_tokens``; the
        engine's step-time target may give fewer)."""
        for request_id in self.connector.take_sent():  # transfers that ended: their blocks go back
            self.release(request_id)
        budget = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        out = SchedulerOutput([], [], [])
        budget = self._schedule_running(budget, out)
        if not out.preempted:
            self._schedule_waiting(budget, out)
        if not out.scheduled and not out.granted and self._only_waiting_gangs():
            out.preempted.extend(self._preempt_all())
            self._schedule_waiting(budget, out)
        out.scheduled.sort(key=lambda s: s.num_new_tokens > 1)  # decode rows first (stable)
        # nothing can run until something ends, or until a waiting sequence's tier blocks arrive
        self._stalled = not (
            out.scheduled or out.granted or out.refused
        ) and not self.connector.wait_for_tier(0.0)
        self._check(out)
        return out

    def grant_head(self) -> list[Sequence]:
        """Grant the reservations at the head of the waiting FIFO (before any local prompt) that
        fit beside what the running sequences need for their next step, so that their senders
        hear before this node's next step computes. The schedule that follows would grant them
        first too; those it must wait for (behind a local prompt, or short of blocks) it grants
        by its usual rules."""
        if not self.waiting or self.connector.num_remote_tokens(self.waiting[0]) == 0:
            return []
        bm = self.block_manager
        running_needs = sum(
            bm.num_blocks_to_append(s, s.num_uncomputed_tokens + len(s.draft_token_ids)) for s in self.running
        )
        out = SchedulerOutput([], [], [])
        self._schedule_waiting(0, out, reserve=running_needs, head_grants_only=True)
        self._check(out)
        return out.granted

    def _schedule_running(self, budget: int, out: SchedulerOutput) -> int:
        """Running sequences, oldest first: their next tokens, preempting the newest when blocks
        run out. The budget left."""
        # Decode rows not yet visited: a prompt chunk leaves them a token each, so a long prompt
        # never holds the running decodes out of a step.
        pending_decodes = sum(s.num_uncomputed_tokens == 1 for s in self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            is_decode = seq.num_uncomputed_tokens == 1
            pending_decodes -= is_decode
            if is_decode:  # its drafts, if any, take only what the decodes after it leave
                num_new = min(1 + len(seq.draft_token_ids), max(1, budget - pending_decodes))
                del seq.draft_token_ids[num_new - 1 :]
                if seq.draft_token_ids and not self.block_manager.can_append(seq, num_new):
                    seq.draft_token_ids, num_new = [], 1  # no sequence is preempted for drafts
            else:
                num_new = min(seq.num_uncomputed_tokens, budget - pending_decodes)
            if num_new <= 0:  # a chunk with no budget left beside the decodes (or a computed beam
                i += 1  # waiting for its siblings): it waits a step
                continue
            while not self.block_manager.can_append(seq, num_new):
                victim = self.running.pop()
                if victim is not seq:
                    pending_decodes -= victim.num_uncomputed_tokens == 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.block_copies.extend(self.block_manager.append(seq, num_new))
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
        return budget

    def _check(self, out: SchedulerOutput) -> None:
        """Cheap invariants of every schedule (the engine runs the full pool check in debug mode)."""
        assert out.num_batched_tokens <= self.max_num_batched_tokens, "token budget exceeded"
        assert all(s.seq.status is SequenceStatus.RUNNING and s.num_new_tokens > 0 for s in out.scheduled), (
            "scheduled a sequence that is not running"
        )
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled), "a sequence scheduled twice"
        assert all(
            s.num_computed_tokens + n.num_new_tokens <= s.num_tokens + len(s.draft_token_ids)
            for n in out.scheduled
            for s in (n.seq,)
        ), "more new tokens than the sequence has"
        assert all(
            n.num_new_tokens == 1 + len(n.seq.draft_token_ids) for n in out.scheduled if n.seq.draft_token_ids
        ), "a drafted decode scheduled without all its drafts"
        assert not any(seq.block_table for seq in self.waiting), "a waiting sequence holds blocks"
        assert all(s.status is SequenceStatus.WAITING_FOR_KV and s.block_table for s in out.granted), (
            "granted a sequence that is not waiting for its KV"
        )
        assert all(s.status is SequenceStatus.HELD_FOR_TRANSFER for s in self.held.values()), (
            "a held sequence in another state"
        )

    def _schedule_waiting(
        self, budget: int, out: SchedulerOutput, reserve: int = 0, head_grants_only: bool = False
    ) -> None:
        """Admit from the waiting FIFO while slots, blocks (beyond the watermark and ``reserve``)
        and, for local prompts, ``budget`` allow. ``head_grants_only``: stop at the first local
        prompt (``grant_head``)."""
        bm = self.block_manager
        reserve += self._watermark()
        # One FIFO for slots and blocks. Compute budget is the one thing a remote reservation does
        # not need: a local prompt waiting for it is passed by the reservations behind it (the local
        # prompts after it stay behind it), or a decode node busy prefilling would grant no KV for
        # as long as its local prompts last, and prefill nodes' transfers time out meanwhile.
        # Likewise a request whose adapter has no LoRA slot is passed by those behind it, but none
        # of them takes a slot nobody holds before it (``may_load``).
        i, prompts_wait, slots_wait = 0, False, False
        while i < len(self.waiting) and self.num_seqs < self.max_num_seqs:
            seq = self.waiting[i]
            assert not seq.block_table, "waiting sequences hold no blocks"
            remote = self.connector.num_remote_tokens(seq) > 0
            if not remote and (head_grants_only or prompts_wait or budget <= 0):
                if head_grants_only:
                    break
                prompts_wait = True
                i += 1
                continue
            if not self.connector.ready(seq):  # its offloaded blocks are on their way: others pass
                i += 1
                continue
            admitted = self._admit(seq, not slots_wait, out)
            if admitted is None:  # refused for good: it left the queue
                continue
            if not admitted:
                slots_wait = True
                i += 1
                continue
            if not self._gang_fits(i, reserve):
                break
            # The pool's hit, then the blocks the offload tier staged after it (connector.ready).
            block_ids, hashes = bm.match_prefix(seq.token_ids, hit_limit(seq, bm.block_size), seq.cache_root)
            bm.take_prefix(seq, block_ids, hashes)
            num_tier = self.connector.num_staged_tokens(seq)
            # A remote prompt's KV all lands at once, and costs this node no compute: no budget.
            num_rest = seq.num_uncomputed_tokens - num_tier
            num_new = num_rest if remote else min(num_rest, budget)
            too_long = not self.enable_chunked_prefill and num_new < num_rest
            if too_long or not bm.can_append(seq, num_tier + num_new, reserve=reserve):
                bm.free(seq)
                seq.num_cached_tokens = 0
                break
            del self.waiting[i]
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self._load_from_tier(seq, num_tier, out)
            out.block_copies.extend(bm.append(seq, num_new))
            if remote:
                self.receiving.append(seq)
                self.connector.allocated(seq)
                out.granted.append(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _load_from_tier(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> None:
        """Blocks for the tier's ``num_tokens`` after the pool's hit: the engine fills them before
        the step computes, so they count as computed (and cached: usage reports them) at once."""
        out.block_copies.extend(self.block_manager.append(seq, num_tokens))
        self.connector.load(seq, num_tokens)
        seq.num_computed_tokens += num_tokens
        seq.num_cached_tokens += num_tokens
        self.block_manager.commit_computed(seq)

    def _admit(self, seq: Sequence, may_load: bool, out: SchedulerOutput) -> bool | None:
        """The per-request admission rule (LoRA slots): may ``seq`` enter now? None when it never
        can: it leaves the queue, refused (``out.refused``)."""
        if self.admission is None:
            return True
        try:
            return self.admission.admit(seq, may_load)
        except ValueError as e:
            self.waiting.remove(seq)
            out.refused.append((seq, str(e)))
            return None

    def _gang_fits(self, i: int, reserve: int) -> bool:
        """The sequences of a request that advance together (a beam search's beams:
        engine/sampling/beam_search.py) come back together or not at all: some admitted while the rest
        wait would hold blocks the rest need. Counts the blocks their recompute takes (fresh ones,
        and cached ones that leave the free pool) and slots; when they fit, the head's siblings
        move up behind it, to be admitted next."""
        bm, head = self.block_manager, self.waiting[i]
        if head.params.beam_search is None:
            return True
        gang = [s for s in self.waiting if s.request_id == head.request_id]
        if len(gang) == 1:
            return True  # the usual checks decide
        num_fresh, cached = 0, set[int]()
        for seq in gang:
            limit = (seq.num_tokens - 1) // bm.block_size
            block_ids, _ = bm.match_prefix(seq.token_ids, limit, seq.cache_root)
            num_fresh += bm.blocks_needed(seq.num_tokens) - len(block_ids)
            cached.update(b for b in block_ids if bm.blocks[b].ref_count == 0)
        fits = num_fresh + len(cached) + reserve <= bm.num_free_blocks
        if not fits or self.num_seqs + len(gang) > self.max_num_seqs:
            return False
        siblings = [s for s in gang if s is not head]
        for seq in siblings:
            self.waiting.remove(seq)
        for k, seq in enumerate(siblings, start=i + 1):
            self.waiting.insert(k, seq)
        return True

    def _only_waiting_gangs(self) -> bool:
        """Every running sequence has its row computed and waits for a preempted sibling (a beam:
        engine/sampling/beam_search.py) that cannot be admitted while they hold their blocks."""
        return (
            bool(self.running)
            and bool(self.waiting)
            and all(s.num_uncomputed_tokens == 0 for s in self.running)
        )

    def _preempt_all(self) -> list[Sequence]:
        """Drop every running sequence back to WAITING, newest first (they recompute from the
        prefix cache), so that the waiting head can be admitted."""
        victims = self.running[::-1]
        self.running.clear()
        for seq in victims:
            self._preempt(seq)
        return victims

    def _preempt(self, seq: Sequence) -> None:
        self.connector.sequence_released(seq)  # its blocks may go to the offload tier
        self.block_manager.free(seq)
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence wherever it is. One the connector holds for a transfer keeps its blocks,
        HELD_FOR_TRANSFER, until ``release``; any other frees them at once."""
        assert status.finished
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.receiving:
            self.receiving.remove(seq)
        self._stalled = False  # its slot and blocks may admit the waiting head
        seq.finish_status = status
        seq.draft_token_ids = []
        self.connector.sequence_released(seq)
        if self.connector.request_finished(seq, status):
            seq.status = SequenceStatus.HELD_FOR_TRANSFER
            return
        self.block_manager.free(seq)
        seq.status = status

    def release(self, request_id: str) -> bool:
        """The held sequence's transfer ended: free its blocks (they stay as prefix cache)."""
        seq = self.connector.release_held(request_id)
        if seq is None:
            return False
        self.block_manager.free(seq)
        assert seq.finish_status is not None  # finish() set it before holding the sequence
        seq.status = seq.finish_status
        self._stalled = False
        return True

    def check_integrity(self) -> None:
        """Assert the block pool's invariants, ref counts against every sequence holding blocks,
        and the admission rule's (adapters pinned only by requests still here)."""
        self.block_manager.check_integrity([*self.running, *self.receiving, *self.held.values()])
        if self.admission is not None:
            live = {s.request_id for s in [*self.waiting, *self.running, *self.receiving]}
            self.admission.check_integrity(live)
