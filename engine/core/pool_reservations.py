"""A decode engine's side of the KV receiver without a model: a scheduler, its block manager and
KV connector queue, grant and hold incoming requests as an engine's do
(``kv_transfer.reservations.BlockReservations``). For transfer benchmarks, the planner's transfer
probe and the kv_transfer tests; a decode node uses its ``LLMEngine``'s connector instead. With no
engine loop here, the scheduler runs whenever its state changes, and its grants go to ``deliver``
(a receiver's ``grant``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.kv_connector import KVConnector, KVTransfer, RemoteReservation
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import Sequence, SequenceStatus
from pdserve.protocol.sampling_params import SamplingParams


class PoolReservations:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int = 1024, max_waiting: int = 1024
    ) -> None:
        self.block_manager = block_manager
        self.connector = KVConnector(block_manager.block_size, block_manager.num_blocks)
        self.scheduler = Scheduler(block_manager, 1 << 20, max_num_seqs, connector=self.connector)
        self.max_waiting = max_waiting
        self.seqs: dict[str, Sequence] = {}  # request id -> its sequence, queued or holding blocks
        self.deliver: Callable[[RemoteReservation], object] = lambda reservation: None

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def reserve(
        self, request_id: str, token_ids: Seq[int], sampling_params: SamplingParams | None
    ) -> int | None:
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.max_waiting:
            return None
        seq = Sequence(request_id, list(token_ids), len(token_ids), sampling_params or SamplingParams())
        self.seqs[request_id] = seq
        self.connector.track(seq, KVTransfer.RECEIVE, 0, 0)
        self.scheduler.add(seq)
        position = len(self.scheduler.waiting) - 1
        self.schedule()
        return position

    def schedule(self) -> None:
        """Grant what the scheduler admits now (an engine does this every step)."""
        self.scheduler.schedule()
        for reservation in self.connector.take_events().granted:
            self.deliver(reservation)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self.connector.forget(request_id)
            self.schedule()

    def arrived(self, request_id: str) -> Sequence:
        """What the engine does when the KV landed (blocks committed as prefix cache); idempotent."""
        seq = self.seqs[request_id]
        if seq.status is SequenceStatus.WAITING_FOR_KV:
            self.scheduler.kv_arrived(seq)
            self.connector.forget(request_id)
        return seq

    def finish(self, request_id: str) -> None:
        """The request decoded to its end: its blocks go back (its full ones stay cached)."""
        self.scheduler.finish(self.arrived(request_id), SequenceStatus.FINISHED_LENGTH)
        del self.seqs[request_id]
        self.schedule()
