"""What a KV receiver asks of the engine that owns its blocks, and what it gets back.

The receiver moves bytes into block ids; the engine decides whether a request may have blocks at
all (the same admission rules as its local requests) and owns the request's state. The decode
node's ``LLMEngine`` is the implementation (``reserve_remote`` / ``abort_request``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from protocol.sampling_params import SamplingParams


class Reservation(Protocol):
    num_held_blocks: int  # leading prompt blocks the engine already holds (prefix cache): not sent
    block_ids: tuple[int, ...]  # the blocks the rest of the prompt's KV lands in, in prompt order


class BlockReservations(Protocol):
    @property
    def num_blocks(self) -> int:
        """Blocks in the engine's pool (a prompt needing more can never be granted)."""
        ...

    def reserve(
        self, request_id: str, token_ids: Sequence[int], sampling_params: SamplingParams | None
    ) -> Reservation | None:
        """Blocks for the prompt's KV, or None while there is no room (the receiver queues it).
        Raises ValueError when the request can never be admitted."""
        ...

    def release(self, request_id: str) -> None:
        """The transfer failed or was aborted: the engine drops the request and its blocks."""
        ...
