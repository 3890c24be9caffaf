"""A decode engine's side of the KV receiver without a model: the engine's own scheduler and block
manager admit and hold incoming requests (``kv_transfer.reservations.BlockReservations``). For
transfer benchmarks, the planner's transfer probe and the kv_transfer tests; a decode node uses
its ``LLMEngine`` instead.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.llm_engine import RemoteReservation
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from protocol.sampling_params import SamplingParams


class PoolReservations:
    """A decode engine's side of the receiver (``kv_transfer.reservations.BlockReservations``)
    without a model: the engine's own scheduler and block manager admit and hold the requests."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 1024) -> None:
        self.block_manager = block_manager
        self.scheduler = Scheduler(block_manager, 1 << 20, max_num_seqs)
        self.seqs: dict[str, Sequence] = {}  # request id -> its sequence, while it holds blocks

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def reserve(self, request_id, token_ids, sampling_params):
        seq = Sequence(request_id, list(token_ids), len(token_ids), sampling_params or SamplingParams())
        if not self.scheduler.reserve(seq):
            return None
        self.seqs[request_id] = seq
        num_held = seq.num_computed_tokens // self.block_manager.block_size
        return RemoteReservation(num_held, tuple(seq.block_table[num_held:]))

    def release(self, request_id: str) -> None:
        self.scheduler.finish(self.seqs.pop(request_id), SequenceStatus.FINISHED_ABORTED)

    def arrived(self, request_id: str) -> Sequence:
        """What the engine does when the KV landed (blocks committed as prefix cache); idempotent."""
        seq = self.seqs[request_id]
        if seq.status is SequenceStatus.WAITING_FOR_KV:
            self.scheduler.kv_arrived(seq)
        return seq

    def finish(self, request_id: str) -> None:
        """The request decoded to its end: its blocks go back (its full ones stay cached)."""
        self.scheduler.finish(self.arrived(request_id), SequenceStatus.FINISHED_LENGTH)
        del self.seqs[request_id]
