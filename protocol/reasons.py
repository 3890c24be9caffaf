"""Why a request's output ended, and why a node gave up on one: typed values on the wire.

They are StrEnums, so a value is also its string ("stop" == FinishReason.STOP) and packs as one;
decoding refuses any other string (protocol/codec.py). OpenAI's strings are made from them at
the router's edge (router/responses.py), the only place that speaks OpenAI.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client, or ended by a failure


class FailureCode(enum.StrEnum):
    """RequestFailed.code: what went wrong on the node (the router decides what to do next)."""

    BAD_MESSAGE = "bad_message"  # a message that did not decode (no request to name)
    BAD_REQUEST = "bad_request"  # the request can never succeed: a 400
    DRAINING = "draining"  # the node is shutting down (or switching roles): try another
    WRONG_ROLE = "wrong_role"  # the node serves another role now (the router's view lagged): try another
    OVERLOADED = "overloaded"  # its queue is full: try another, or 503
    DECODE_REJECTED = "decode_rejected"  # the decode node refused the KV reservation
    KV_TRANSFER = "kv_transfer"  # the KV transfer failed
    TIMEOUT = "timeout"  # the request outlived its time to live on the node
    INTERNAL = "internal"  # an unexpected error on the node
    OVERFLOW = "overflow"  # router side: the client did not read its output fast enough

    @property
    def unavailable(self) -> bool:
        """The node could not take the request now, another may (a 503 when none did)."""
        return self in (FailureCode.OVERLOADED, FailureCode.DRAINING, FailureCode.WRONG_ROLE)
