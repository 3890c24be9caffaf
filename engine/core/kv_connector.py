"""The scheduler's KV connector: which requests' KV crosses to or from another node, and what the
node's transport must hear of them (vLLM v1's scheduler-side connector is the model).

The scheduler owns it and calls it at three points: how many of a waiting request's tokens a peer
computes (``num_remote_tokens``), which blocks it allocated for them (``allocated``), and that a
request finished (``request_finished``: hold its blocks for a transfer?). What the transport must
act on comes back in the step's result (``take_events``: grants, and KV held for a send); what the
transport reports (KV landed, a send ended) is queued here and applied by the next step. The
requests, their sequences and blocks stay the scheduler's; this keeps one transfer state per
request and nothing else.

    receive (a decode node): KVReserve ─► reserve() ─► the engine's add path (KVTransfer.RECEIVE):
        WAITING_FOR_KV in the waiting FIFO ─► a step allocates its blocks ─► granted (step result)
        ─► the transport lands the KV ─► kv_arrived() ─► the next step: RUNNING, first token taken
    send (a prefill node): add (KVTransfer.SEND): prompt, first token ─► request_finished: held
        (step result) ─► the transport ships it ─► send_finished() ─► the next step frees the
        blocks (they stay as prefix cache); a first token that ends the request holds nothing

It is also the transport's view of the engine (``kv_transfer.reservations.BlockReservations``:
``num_blocks``, ``reserve``, ``abort``), so a reservation climbs one floor, from the receiver to here.

With an offload tier (engine/offload/), the same three questions take it in: a waiting sequence
is admitted once the blocks the tier holds past the pool's hit are staged (``ready``, fetched in
the background meanwhile), those count as matched (``num_staged_tokens``: a received prompt's
reservation says so, and its sender skips them), and the engine fills the blocks the scheduler
allocated for them before the step computes (``take_loads``). A sequence that finishes or is
preempted offers its full blocks to the tier (``sequence_released``), which the engine copies out
before any write can reuse them (``take_saves``):

    waiting ─ready?─► lookup: pool hit, then the tier's run ─► prefetch (reader thread) ─► staged
    admitted: blocks allocated ─► take_loads (engine: filled before the forward pass)
    finished / preempted ─► take_saves (engine: copied out) ─► pending ─► writer thread ─► folder
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from pdserve.engine.core.requests import QueueFullError
from pdserve.engine.core.sequence import Sequence, SequenceStatus, TokenLogprob
from pdserve.protocol.block_hash import hash_block
from pdserve.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pdserve.engine.core.block_manager import BlockManager
    from pdserve.engine.offload.disk import StoredBlock
    from pdserve.engine.offload.tiers import KVOffload, Prefetch


class KVTransfer(enum.Enum):
    """A request's part in a transfer (``LLMEngine.add_request(kv_transfer=...)``)."""

    SEND = "send"  # the prompt runs here; its KV goes to a peer, which decodes on
    RECEIVE = "receive"  # the prompt's KV comes from a peer; decoding runs here


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteReservation:
    """Blocks a step granted to a request whose prompt KV a peer sends."""

    request_id: str
    num_held_blocks: int  # leading prompt blocks already in this engine's prefix cache: not sent
    block_ids: tuple[int, ...]  # the blocks the rest of the prompt's KV lands in, in prompt order


@dataclasses.dataclass(frozen=True, slots=True)
class HeldKV:
    """A sent request's prompt KV, held for its transfer until ``send_finished``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]  # the prompt's blocks, in prompt order
    first_scheduled_time: float | None  # time.monotonic() when its prompt first got compute


@dataclasses.dataclass(frozen=True, slots=True)
class KVEvents:
    """What a step tells the node's transport."""

    granted: tuple[RemoteReservation, ...] = ()  # receive: blocks allocated, tell the sender
    held: tuple[HeldKV, ...] = ()  # send: first token out, KV held: ship it

    def __bool__(self) -> bool:
        return bool(self.granted or self.held)


@dataclasses.dataclass(slots=True)
class _Send:
    request_max_tokens: int  # the request's own output limit (its sequence here stops at one)
    always_continues: bool  # a beam search: its first step is the peer's, whatever the token


@dataclasses.dataclass(slots=True)
class _Receive:
    num_first_candidates: int  # a beam search's first step needs this many first-token logprobs
    granted: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class KVArrival:
    """A received request's KV landed, with the first token the peer sampled (and its logprobs)."""

    request_id: str
    first_token: int
    first_logprob: TokenLogprob | None


class KVConnector:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int | None = None,
        add: Callable[..., int] | None = None,
        abort: Callable[[str], object] | None = None,
        block_manager: BlockManager | None = None,
        offload: KVOffload | None = None,
    ) -> None:
        """``add``: the engine's add path (``LLMEngine.add_request``), through which a reservation
        enters like any request; ``abort``: its abort (a transfer that failed). Without them the
        connector takes no reservation (a scheduler tested alone). ``offload``: the node's
        offload tier (None: none), over ``block_manager``'s pool."""
        assert offload is None or block_manager is not None, "an offload tier needs the pool's block manager"
        self.block_manager, self.offload = block_manager, offload
        self._prefetches: dict[int, _Lookup] = {}  # seq_id -> its tier blocks' lookup and fetch
        self._loads: list[tuple[int, torch.Tensor]] = []  # (block id, payload) to fill before the step
        self._saves: dict[int, tuple[int, tuple[int, ...]]] = {}  # block hash -> (block id, tokens) to keep
        self.block_size = block_size
        self.num_blocks = num_blocks  # the pool's (a prompt needing more can never be granted)
        self.max_model_len = max_model_len
        self._add, self._abort = add, abort
        self._sends: dict[str, _Send] = {}  # request id -> its send, from add to send_finished
        self._held: dict[str, Sequence] = {}  # sends whose blocks are held, HELD_FOR_TRANSFER
        self._receives: dict[str, _Receive] = {}  # request id -> its receive, from add to landing
        self._granted: list[RemoteReservation] = []  # since the last take_events
        self._new_held: list[HeldKV] = []
        self._arrived: list[KVArrival] = []  # reported by the transport, for the next step
        self._sent: list[str] = []

    # ------------------------------------------------------------------ the transport's calls
    def reserve(self, request_id: str, token_ids: Seq[int], params: SamplingParams | None) -> int | None:
        """A peer asks to send a prompt's KV: the request enters through the engine's add path,
        WAITING_FOR_KV; a later step grants its blocks. Its place in the waiting queue, or None
        while the queue is full; ValueError when it can never be admitted. Stop strings stay with
        the router, as for local requests."""
        assert self._add is not None, "this connector was built without the engine's add path"
        params = dataclasses.replace(params or SamplingParams(), stop=())
        try:
            return self._add(request_id, list(token_ids), params, kv_transfer=KVTransfer.RECEIVE)
        except QueueFullError:
            return None

    def abort(self, request_id: str) -> None:
        """The transfer failed, or its grant came too late: the request and its blocks go."""
        assert self._abort is not None, "this connector was built without the engine's abort"
        self._abort(request_id)

    def kv_arrived(
        self, request_id: str, first_token: int, first_logprob: TokenLogprob | None = None
    ) -> None:
        """The received request's KV landed: the next step takes its first token and decodes it.
        ValueError when what came cannot start it (a beam search's first step needs its candidates)."""
        receive = self._receives.get(request_id)
        if receive is None or not receive.granted:
            raise ValueError(f"{request_id}: no granted reservation to land KV in")
        if receive.num_first_candidates and (
            first_logprob is None or len(first_logprob.top) < receive.num_first_candidates
        ):
            raise ValueError("a beam search's prompt came without its first step's candidates")
        self._arrived.append(KVArrival(request_id, first_token, first_logprob))

    def send_finished(self, request_id: str) -> bool:
        """The held request's transfer ended (or will not start): the next step frees its blocks,
        which stay as prefix cache. False when it is not held."""
        if request_id not in self._held or request_id in self._sent:
            return False
        self._sent.append(request_id)
        return True

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    @property
    def has_pending(self) -> bool:
        """Reports of the transport that the next step applies, or blocks to keep in the tier."""
        return bool(self._arrived or self._sent or self._saves)

    # ------------------------------------------------------------------ the engine's
    def track(
        self, seq: Sequence, transfer: KVTransfer, request_max_tokens: int, num_first_candidates: int
    ) -> None:
        """A request added with its part in a transfer (its sequence already set up for it)."""
        if transfer is KVTransfer.SEND:
            self._sends[seq.request_id] = _Send(request_max_tokens, num_first_candidates > 0)
        else:
            self._receives[seq.request_id] = _Receive(num_first_candidates)

    def take_arrived(self) -> list[KVArrival]:
        arrived, self._arrived = self._arrived, []
        for a in arrived:
            self._receives.pop(a.request_id, None)
        return arrived

    def take_sent(self) -> list[str]:
        sent, self._sent = self._sent, []
        return sent

    def take_events(self) -> KVEvents:
        events = KVEvents(tuple(self._granted), tuple(self._new_held))
        self._granted, self._new_held = [], []
        return events

    def forget(self, request_id: str) -> None:
        """The request left the engine (aborted, or done): its transfer state goes, reports of it
        not yet applied too. Held blocks stay until ``release_held``."""
        self._sends.pop(request_id, None)
        self._receives.pop(request_id, None)
        self._arrived = [a for a in self._arrived if a.request_id != request_id]

    def release_held(self, request_id: str) -> Sequence | None:
        """The held sequence of a send whose transfer ended (the caller frees its blocks); None
        when it is not held."""
        self._sent = [r for r in self._sent if r != request_id]
        return self._held.pop(request_id, None)

    # ------------------------------------------------------------------ the scheduler's calls
    def num_remote_tokens(self, seq: Sequence) -> int:
        """Of a waiting sequence's uncomputed tokens, how many a peer computes (all of a received
        prompt's; they cost this node no compute budget)."""
        return seq.num_uncomputed_tokens if seq.request_id in self._receives else 0

    def allocated(self, seq: Sequence) -> None:
        """A received prompt's blocks were allocated: its prefix hits are held here, the rest is
        sent into the blocks after them."""
        self._receives[seq.request_id].granted = True
        num_held = seq.num_computed_tokens // self.block_size
        self._granted.append(RemoteReservation(seq.request_id, num_held, tuple(seq.block_table[num_held:])))

    def request_finished(self, seq: Sequence, status: SequenceStatus) -> bool:
        """A sequence ends: True when its blocks stay held for a send (the request goes on on the
        peer: its first token did not end it). A send that ends here forgets its state."""
        send = self._sends.pop(seq.request_id, None)
        if send is None or status is SequenceStatus.FINISHED_ABORTED:
            return False
        at_context = self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        continues = send.always_continues or (
            status is SequenceStatus.FINISHED_LENGTH
            and not at_context
            and seq.num_output_tokens < send.request_max_tokens
        )
        if not continues:
            return False
        assert seq.request_id not in self._held, f"{seq.request_id} held twice"
        self._held[seq.request_id] = seq
        prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
        self._new_held.append(
            HeldKV(seq.request_id, prompt, tuple(seq.block_table), seq.first_scheduled_time)
        )
        return True

    @property
    def held(self) -> dict[str, Sequence]:
        """Sends whose blocks are held (HELD_FOR_TRANSFER), by request id."""
        return self._held

    # ------------------------------------------------------------------ the offload tier's part
    def ready(self, seq: Sequence) -> bool:
        """May this waiting sequence be admitted now? Not while the blocks the tier holds past the
        pool's hit are on their way (at most the tier's prefetch deadline). A lookup made before
        the pool evicted an entry, or before the sequence grew (preempted), is made again."""
        if self.offload is None:
            return True
        assert self.block_manager is not None
        lookup = self._prefetches.get(seq.seq_id)
        stale = lookup is None or (
            (lookup.evictions, lookup.num_tokens) != (self.block_manager.num_evictions, seq.num_tokens)
            and (lookup.job is None or lookup.job.ready)
        )
        if stale:
            lookup = self._prefetches[seq.seq_id] = _Lookup(
                self._start_prefetch(seq), self.block_manager.num_evictions, seq.num_tokens
            )
        assert lookup is not None
        return lookup.job is None or lookup.job.ready

    def _start_prefetch(self, seq: Sequence) -> Prefetch | None:
        """Fetch the run of blocks the tier holds right after the pool's leading hit."""
        assert self.offload is not None and self.block_manager is not None
        bm, size = self.block_manager, self.block_size
        limit = hit_limit(seq, size)
        parent, first, entries = seq.cache_root, None, []
        for i in range(limit):
            tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
            parent = hash_block(parent, tokens)
            if first is None:
                block_id = bm.hash_to_block_id.get(parent)
                if block_id is not None and bm.blocks[block_id].token_ids == tokens:
                    continue  # in the pool
                first = i
            if not self.offload.contains(parent):
                break
            entries.append((parent, tokens))
        return None if not entries else self.offload.prefetch(first or 0, entries)

    def wait_for_tier(self, timeout_s: float) -> bool:
        """Whether a waiting sequence's blocks are on their way from the tier; waits up to
        ``timeout_s`` for the first of them (a step that found nothing else to do)."""
        for lookup in self._prefetches.values():
            job = lookup.job
            if job is not None and not job.ready:
                job.done.wait(min(timeout_s, max(0.0, job.deadline - time.monotonic())))
                return True
        return False

    def num_staged_tokens(self, seq: Sequence) -> int:
        """Of the tokens after the sequence's computed prefix (the pool's hit), how many the tier
        staged: matched, to be filled from the tier rather than computed."""
        lookup = self._prefetches.get(seq.seq_id)
        job = None if lookup is None else lookup.job
        if job is None:
            return 0
        at = seq.num_computed_tokens // self.block_size
        end = min(job.first_block + len(job.payloads), hit_limit(seq, self.block_size))
        if seq.num_computed_tokens % self.block_size or not job.first_block <= at < end:
            return 0
        return (end - at) * self.block_size

    def load(self, seq: Sequence, num_tokens: int) -> None:
        """The scheduler admitted the sequence with ``num_tokens`` from the tier, its blocks for
        them allocated after its computed prefix: the engine fills them before the step computes."""
        lookup = self._prefetches.pop(seq.seq_id, None)
        job = None if lookup is None else lookup.job
        if job is None or self.offload is None:
            assert num_tokens == 0
            return
        if not job.done.is_set():
            self.offload.note_timed_out()
        at = seq.num_computed_tokens // self.block_size
        num = num_tokens // self.block_size
        for j in range(num):
            self._loads.append((seq.block_table[at + j], job.payloads[at - job.first_block + j]))
        if num:
            self.offload.loaded_into_pool(job, at - job.first_block + num)

    def take_loads(self) -> list[tuple[int, torch.Tensor]]:
        """(block id, payload [layers, 2, block_size, kv_heads, row]) to fill before the step computes."""
        loads, self._loads = self._loads, []
        return loads

    def sequence_released(self, seq: Sequence) -> None:
        """The sequence's blocks are about to go back (it finished or was preempted): its full,
        computed blocks the tier lacks are to be kept. Its prefetch, if any, is dropped."""
        self._prefetches.pop(seq.seq_id, None)
        if self.offload is None:
            return
        size = self.block_size
        for i, block_hash in enumerate(seq.block_hashes):
            if block_hash not in self._saves and not self.offload.contains(block_hash):
                tokens = tuple(seq.token_ids[i * size : (i + 1) * size])
                self._saves[block_hash] = (seq.block_table[i], tokens)

    def keep(self, blocks: list[StoredBlock]) -> None:
        """The blocks ``take_saves`` named, copied out of the pool: into the tier."""
        assert self.offload is not None
        self.offload.save(blocks)

    def take_saves(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(block id, block hash, token ids) to copy out of the pool and keep. A released block
        may have been handed on by the schedule since (its hash entry evicted), but nothing has
        written it: the engine copies these between the schedule and anything that writes."""
        saves, self._saves = self._saves, {}
        return [(b, h, t) for h, (b, t) in saves.items()]


@dataclasses.dataclass(frozen=True, slots=True)
class _Lookup:
    """A waiting sequence's look into the offload tier, and the pool state it was made in."""

    job: Prefetch | None  # the blocks on their way (None: the tier has none past the pool's hit)
    evictions: int  # the block manager's num_evictions then
    num_tokens: int  # the sequence's length then


def hit_limit(seq: Sequence, block_size: int) -> int:
    """The leading blocks a hit may cover: never the last token (it must run to give logits), nor
    a prompt whose logprobs are still to be reported (those positions are computed again)."""
    return 0 if seq.needs_prompt_logprobs else (seq.num_tokens - 1) // block_size
