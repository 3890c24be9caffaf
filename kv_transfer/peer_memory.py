"""Receiver side of the same-host paths: map a sender's staging ring or its whole KV cache.

Both are offered in ``KVReserve`` (``ring_ref`` / ``cache_ref``) and used only when the sender
runs on this host (same ``host_id``) and the mapping succeeds; otherwise chunks travel on the
socket. Mappings are read-only, cached per sender, and bounded in number.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections import OrderedDict

import numpy as np
import torch
import xxhash

from pdserve.kernels import cpu_ext
from pdserve.kv_transfer import memfd, shared_cache, staging
from pdserve.kv_transfer.messages import KVFingerprint, KVReserve

MAX_MAPPINGS = 64  # per kind: sender rings and sender caches kept mapped
# The direct copy hashes what it copied one tile at a time, while the tile is still in the CPU's
# cache, instead of reading the whole layer back from memory afterwards.
TILE_BYTES = 256 * 1024


class PeerMemory:
    def __init__(self, fingerprint: KVFingerprint, enabled: bool) -> None:
        self.fingerprint = fingerprint
        self.enabled = enabled
        self.host_id = staging.host_id()
        # Keyed by (pid, fd, size, the memfd's device and inode): a sender that closes its ring
        # and makes a new one may get the same descriptor back, and the old mapping is stale.
        self._rings: OrderedDict[tuple, mmap.mmap] = OrderedDict()  # sender rings
        self._caches: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # sender caches

    def _same_host(self, msg: KVReserve) -> bool:
        return self.enabled and msg.host_id == self.host_id

    def map_cache(self, msg: KVReserve) -> torch.Tensor | None:
        """The sender's whole KV cache [L, 2, NB, bs, kvh, d], read-only, for the one-copy path."""
        if msg.cache_ref is None or not self._same_host(msg):
            return None
        ref = msg.cache_ref
        try:
            key = (ref.pid, ref.fd, ref.num_blocks, *memfd.identity(ref.pid, ref.fd))
        except OSError:
            return None  # another PID namespace or user, or the sender is gone: chunks it is
        if key not in self._caches:
            try:
                self._caches[key] = shared_cache.attach(ref, self.fingerprint)
            except (OSError, ValueError):
                return None  # another PID namespace or user: chunks it is
            _bound(self._caches)
        self._caches.move_to_end(key)
        return self._caches[key]

    def map_ring(self, msg: KVReserve) -> memoryview | None:
        """The sender's shared staging ring, so chunks name slots instead of carrying frames."""
        ref = msg.ring_ref
        if ref is None or not self._same_host(msg):
            return None
        try:
            key = (ref.pid, ref.fd, ref.num_bytes, *memfd.identity(ref.pid, ref.fd))
        except OSError:
            return None  # fall back to frames on the socket
        if key not in self._rings:
            try:
                self._rings[key] = staging.attach(ref)
            except (OSError, ValueError):
                return None  # fall back to frames on the socket
            _bound(self._rings)
        self._rings.move_to_end(key)
        return memoryview(self._rings[key])

    def close(self) -> None:
        self._rings.clear()  # the mappings close once no view refers to them
        self._caches.clear()


def _bound(mappings: OrderedDict) -> None:
    while len(mappings) > MAX_MAPPINGS:
        mappings.popitem(last=False)


def copy_direct(
    src: torch.Tensor,
    src_ids: list[int],
    key_caches,
    value_caches,
    dst_ids: torch.Tensor,
) -> list[int] | str:
    """Copy blocks ``src_ids`` of a mapped sender cache into ``dst_ids`` of ours, layer by layer;
    returns each layer's ``shared_cache.layer_checksum`` of what landed, computed tile by tile as
    it lands, or the problem. The caller compares the checksums with the sender's.

    src: [L, 2, NB_sender, bs, kvh, d]; key_caches / value_caches: per layer [NB, bs, kvh, d].
    """
    if len(src_ids) != len(dst_ids) or any(not 0 <= b < src.shape[2] for b in src_ids):
        return f"direct transfer names {len(src_ids)} source blocks for {len(dst_ids)} granted"
    block_bytes = key_caches[0][0].numel() * key_caches[0].element_size()
    if cpu_ext.enabled() and cpu_ext.xxh3_streams(block_bytes, len(src_ids)):
        return _copy_direct_fused(src, src_ids, key_caches, value_caches, dst_ids)
    pairs = shared_cache.paired_runs(src_ids, dst_ids.tolist())  # usually few: blocks come in runs
    tile = max(1, TILE_BYTES // block_bytes)  # blocks per tile
    sums = []
    for layer in range(len(key_caches)):
        digest = xxhash.xxh3_64()  # K blocks then V blocks in grant order, as the sender hashes them
        for kind, cache in enumerate((key_caches[layer], value_caches[layer])):
            rows = cache.view(cache.shape[0], -1).view(torch.uint8).numpy()  # [NB, block bytes]
            src_rows = src[layer, kind].reshape(src.shape[2], -1).view(torch.uint8).numpy()
            for s, d, n in pairs:
                for i in range(0, n, tile):
                    m = min(tile, n - i)
                    landed = rows[d + i : d + i + m]
                    np.copyto(landed, src_rows[s + i : s + i + m])  # ~2-3x torch's copy_ here
                    digest.update(memoryview(landed).cast("B"))  # while the tile is still in cache
        sums.append(digest.intdigest())
    return sums


def _copy_direct_fused(src: torch.Tensor, src_ids: list[int], key_caches, value_caches, dst_ids) -> list[int]:
    """copy_direct in one pass a layer: the C++ kernel loads each 64 bytes once, stores them and
    folds them into the XXH3 state (kernels/csrc/kv_copy_cpu.cpp); the same digests as xxhash's."""
    ids = torch.tensor(src_ids, dtype=torch.int64)
    dst = dst_ids.to(torch.int64).contiguous()
    sums = []
    for layer in range(len(key_caches)):
        k_src, v_src = (src[layer, kind].reshape(src.shape[2], -1).view(torch.uint8) for kind in (0, 1))
        k_dst, v_dst = (
            c.view(c.shape[0], -1).view(torch.uint8) for c in (key_caches[layer], value_caches[layer])
        )
        sums.append(cpu_ext.copy_blocks_xxh3(k_src, v_src, k_dst, v_dst, ids, dst))
    return sums


def checksum_problem(landed: list[int], expected: tuple[int, ...]) -> str | None:
    """Where the receiver's per-layer checksums of a direct copy differ from the sender's."""
    if len(expected) != len(landed):
        return "direct transfer without a checksum per layer"
    for layer, (got, want) in enumerate(zip(landed, expected, strict=True)):
        if got != want:
            return f"checksum mismatch in layer {layer} (direct)"
    return None


@dataclasses.dataclass(slots=True)
class DirectCopy:
    """One direct grant's copy out of a mapped sender cache: made at the grant when the reserve's
    block table fits it, while the sender computes the checksums on its own core; judged at KVDone
    against the sender's checksums (and made then, of the blocks KVDone names, if not before or
    if those differ)."""

    src: torch.Tensor  # the sender's mapped cache [L, 2, NB, ...]
    copied: tuple[tuple[int, ...], list[int]] | None = None  # (sender blocks, per-layer checksums)

    def at_grant(self, table: tuple[int, ...], num_held: int, key_caches, value_caches, dst_ids) -> None:
        if len(table) != num_held + len(dst_ids):
            return
        src_ids = table[num_held:]
        sums = copy_direct(self.src, list(src_ids), key_caches, value_caches, dst_ids)
        if not isinstance(sums, str):  # a problem is reported at KVDone, by the copy made there
            self.copied = (src_ids, sums)

    def at_done(
        self, src_ids: tuple[int, ...], checksums: tuple[int, ...], key_caches, value_caches, dst_ids
    ) -> str | None:
        """The problem with what landed, or None."""
        sums: list[int] | str
        if self.copied is not None and self.copied[0] == src_ids:
            sums = self.copied[1]
        else:
            sums = copy_direct(self.src, list(src_ids), key_caches, value_caches, dst_ids)
        return sums if isinstance(sums, str) else checksum_problem(sums, checksums)
