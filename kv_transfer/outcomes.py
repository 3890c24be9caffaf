"""What a KV receiver reports upward from ``KVReceiver.poll``: requests whose KV landed, and failures."""

from __future__ import annotations

import dataclasses

from pdserve.kv_transfer.errors import KVTransferError
from pdserve.kv_transfer.messages import RequestMeta, TokenLogprobs
from pdserve.protocol.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivedKV:
    """A request whose prompt KV landed in the blocks the engine reserved for it."""

    request_id: str
    first_token: int  # sampled by the prefill node
    num_held_blocks: int  # blocks reused from this node's prefix cache (not sent)
    bytes_received: int  # chunk payload bytes
    prefill_cached_tokens: int  # usage: prompt tokens the prefill node took from its cache
    request_meta: RequestMeta | None = None  # KVReserve.request_meta, passed through untouched
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the request asked for logprobs
    num_prompt_tokens: int = 0  # the prompt's length (KVReserve.token_ids)
    sampling_params: SamplingParams | None = None  # KVReserve.sampling_params


@dataclasses.dataclass(frozen=True, slots=True)
class TransferFailure:
    request_id: str
    error: KVTransferError  # KVTimeout, KVAborted (peer abort, bad frame)
    request_meta: RequestMeta | None = None  # KVReserve.request_meta, so the node can tell whoever waits


@dataclasses.dataclass(slots=True)
class PollResult:
    completed: list[ReceivedKV] = dataclasses.field(default_factory=list)
    failed: list[TransferFailure] = dataclasses.field(default_factory=list)
    # Messages refused with an Error reply (malformed, unexpected, unknown request): for the node's
    # log. They end no transfer, so they do not end a poll either.
    refused: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.completed or self.failed)
