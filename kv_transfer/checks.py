"""What a receiver checks before it grants a reservation or lands a chunk: pure functions.

Each returns the problem (a reason, and for reservations the offending field) or None, so the
receiver can answer ``KVReject`` / fail the request without ever trusting a peer's numbers.
"""

from __future__ import annotations

import math

import torch

from pdserve.kv_transfer import tensors
from pdserve.kv_transfer.messages import KVChunk, KVFingerprint, KVReserve
from pdserve.protocol.block_hash import cache_root_of, hash_full_blocks


def reserve_problem(
    msg: KVReserve, fingerprint: KVFingerprint, pool_blocks: int, draining: bool, duplicate: bool
) -> tuple[str, str | None] | None:
    """(reason, field) when the reservation can never be granted here."""
    if draining:
        return "receiver is draining: no new reservations", None
    field = fingerprint.first_difference(msg.fingerprint)
    if field is not None:
        mine, theirs = getattr(fingerprint, field), getattr(msg.fingerprint, field)
        return f"fingerprint mismatch: {field} is {theirs!r} here {mine!r}", field
    if duplicate:
        return "duplicate request id", "request_id"
    if not msg.token_ids:
        return "empty prompt", "token_ids"
    if -(-len(msg.token_ids) // fingerprint.block_size) > pool_blocks:
        return f"{len(msg.token_ids)} tokens can never fit in {pool_blocks} blocks", "token_ids"
    if not (math.isfinite(msg.ttl_s) and msg.ttl_s > 0):
        return "ttl_s must be positive", "ttl_s"
    params = msg.sampling_params
    root = None if params is None else cache_root_of(params.adapter, params.cache_salt)
    if list(msg.block_hashes) != hash_full_blocks(msg.token_ids, fingerprint.block_size, parent_hash=root):
        return "block hashes do not match the token ids", "block_hashes"
    return None


def ring_frames(ring: memoryview | None, msg: KVChunk, cache: torch.Tensor, wire_format) -> list[memoryview]:
    """A chunk's frames as views of the sender's shared ring ([] when they cannot be there,
    which then fails ``chunk_problem``). cache: any layer's cache, for the block shape and dtype."""
    start = msg.shm_offset
    assert start is not None, "only a chunk sent through the ring has frames there"
    sizes = tensors.frame_sizes(tuple(cache.shape[1:]), cache.dtype, msg.num_blocks, wire_format)
    offsets, total = tensors.frame_offsets(sizes)
    if ring is None or start + total > len(ring):
        return []
    return [ring[start + o : start + o + n] for o, n in zip(offsets, sizes, strict=True)]


def chunk_problem(
    msg: KVChunk,
    frames: list[memoryview],
    num_layers: int,
    num_send_blocks: int,
    landed: bytearray,
    cache: torch.Tensor,
    wire_format,
) -> str | None:
    """Why a chunk cannot land: outside the grant, sent twice, wrong sizes or a bad checksum."""
    if not (
        msg.layer < num_layers and 0 < msg.num_blocks and msg.block_start + msg.num_blocks <= num_send_blocks
    ):
        return f"chunk layer {msg.layer} blocks {msg.block_start}+{msg.num_blocks} outside the grant"
    first = msg.layer * num_send_blocks + msg.block_start
    if any(landed[first : first + msg.num_blocks]):
        return f"chunk layer {msg.layer} block {msg.block_start} sent twice"
    sizes = tensors.frame_sizes(tuple(cache.shape[1:]), cache.dtype, msg.num_blocks, wire_format)
    if [len(f) for f in frames] != sizes:
        return f"chunk frame sizes {[len(f) for f in frames]}, expected {sizes}"
    for i, (frame, expected) in enumerate(zip(frames, msg.checksums, strict=True)):
        if tensors.checksum(frame) != expected:
            return f"checksum mismatch in layer {msg.layer} frame {i}"
    return None
