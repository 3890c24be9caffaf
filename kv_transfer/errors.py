"""Typed failures of a KV transfer, raised on the prefill side and reported on the decode side."""

from __future__ import annotations


class KVTransferError(Exception):
    """A transfer did not complete; whoever holds blocks for it frees them."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"{request_id}: {message}")
        self.request_id = request_id


class KVRejected(KVTransferError):
    """The decode node refused the reservation (it will never be granted)."""

    def __init__(self, request_id: str, reason: str, field: str | None = None) -> None:
        super().__init__(request_id, f"rejected: {reason}" + (f" (field {field})" if field else ""))
        self.reason = reason
        self.field = field  # e.g. the fingerprint field that differs


class KVTimeout(KVTransferError):
    """A deadline passed while waiting; the peer is slow, stuck or dead."""

    def __init__(self, request_id: str, stage: str) -> None:
        super().__init__(request_id, f"timed out waiting for {stage}")
        self.stage = stage  # "grant", "credit", "ack" (sender); "grant", "chunk" (receiver)


class KVAborted(KVTransferError):
    """The peer aborted the request, or a frame failed its checks."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(request_id, f"aborted: {reason}")
        self.reason = reason
