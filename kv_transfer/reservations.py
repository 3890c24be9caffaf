"""What a KV receiver asks of the engine that owns its blocks, and what it gets back.

The receiver moves bytes into block ids; the engine owns the request. It queues the request with
its own waiting prompts, grants its blocks from its own scheduling loop (the same admission rules
as its local requests), and is told when a transfer fails. The decode node's engine connector is
the implementation (engine/core/kv_connector.py: ``reserve`` and ``abort``); its grants come back in
the engine's step result, and the node hands each to ``KVReceiver.grant``. An abort the node
starts goes to the engine first, which says whether a transfer must stop (``KVReceiver.stop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.protocol.sampling_params import SamplingParams


class Reservation(Protocol):
    # read-only members, so that a frozen record (the engine's RemoteReservation) is one
    @property
    def request_id(self) -> str: ...

    @property
    def num_held_blocks(self) -> int:
        """Leading prompt blocks the engine already holds (prefix cache): not sent."""
        ...

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The blocks the rest of the prompt's KV lands in, in prompt order."""
        ...


class BlockReservations(Protocol):
    @property
    def num_blocks(self) -> int:
        """Blocks in the engine's pool (a prompt needing more can never be granted)."""
        ...

    def reserve(
        self, request_id: str, token_ids: Sequence[int], sampling_params: SamplingParams | None
    ) -> int | None:
        """Queue the request for blocks: its place in the engine's waiting queue, or None while
        that queue is full. Raises ValueError when the request can never be admitted. The blocks
        come later: the node hands each grant to ``KVReceiver.grant``."""
        ...

    def abort(self, request_id: str) -> None:
        """The transfer failed or its grant came too late: the engine drops the request and its blocks."""
        ...
