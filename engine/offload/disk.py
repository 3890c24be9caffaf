"""A folder of KV blocks that outlives the node: content-addressed, checksummed, bounded, atomic.

    DIR/<namespace>/                   one namespace per KV format (model, dtypes, block size,
        .lock                          layout, heads): a node reads only blocks it can use; the
        <hh>/<block hash, 16 hex>.kv   lock keeps one node per namespace folder

A file holds one full block, every layer's K and V, under the block's chained hash (the prefix
cache's, whose root covers the adapter and cache salt), so equal names mean equal prefixes:

    b"PDKV" | u16 version | u32 header length | msgpack header | payload
    header: namespace, block hash, the block's token ids, payload shape and dtype, xxh3_64 of payload

A file is written under a temporary name and renamed into place, so a reader sees a whole block or
none, also across a crash. A read checks the magic, the namespace, the hash, the token ids (a
64-bit collision) and the checksum; a file that fails is deleted, counted and never served. At
start the index is rebuilt from the folder's names, sizes and modification times (newest last),
within a time bound; leftover temporary files go, unknown ones are skipped with a log line. The
folder never grows past its budget: the least recently used files go first, recency being touched
once per request that loads a block (the file's mtime, so it survives a restart too).

Every method is thread-safe: the node's engine thread looks blocks up, one background writer
stores and one background reader loads (engine/offload/tiers.py).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import struct
import threading
import time
import uuid

import msgpack
import torch
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
SUFFIX = ".kv"
SCAN_TIME_LIMIT_S = 10.0  # the start-up index rebuild stops here (the rest is found as files miss)
STALE_TEMP_S = 60.0  # temporary files older than this are a crashed writer's


class TierInUse(ValueError):
    """Another process holds the folder's namespace (one node per folder and KV format)."""


def namespace_of(fingerprint: dict[str, object]) -> str:
    """The folder of a KV format: a digest of every field that must match for a block to be usable."""
    text = json.dumps(fingerprint, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclasses.dataclass(frozen=True, slots=True)
class StoredBlock:
    """One block as it crosses to or from the folder."""

    block_hash: int  # its chained hash (protocol.block_hash)
    token_ids: tuple[int, ...]  # the block's tokens, re-checked on load
    payload: torch.Tensor  # [num_layers, 2, block_size, kv_heads, row] in the cache dtype, contiguous


@dataclasses.dataclass(slots=True)
class DiskCounts:
    """The folder's work since start (a node's /metrics)."""

    stored: int = 0  # blocks written
    loaded: int = 0  # blocks read back and verified
    evicted: int = 0  # files removed for the budget
    corrupt: int = 0  # files that failed a check: deleted, never served
    foreign: int = 0  # files in the folder that are no block of this namespace: skipped
    missing: int = 0  # indexed files gone when read (another process, or a disk problem)


class DiskTier:
    def __init__(self, root: str | pathlib.Path, namespace: str, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"kv_offload_disk_mb: the folder's budget must be positive, got {budget_bytes}")
        self.folder = pathlib.Path(root) / namespace
        self.folder.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.budget_bytes = budget_bytes
        self.counts = DiskCounts()
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[int, int] = collections.OrderedDict()  # hash -> bytes, LRU first
        self.num_bytes = 0
        self._lock_file = self._take_folder()
        self.rebuilt_in_s = self._rebuild()

    # ------------------------------------------------------------------ start-up
    def _take_folder(self):
        """The namespace folder's lock: one node writes and evicts here (a second is refused)."""
        handle = open(self.folder / ".lock", "a+")  # noqa: SIM115 - held for the tier's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            handle.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise TierInUse(
                    f"kv_offload_dir: {self.folder} is in use by another pdserve node; give each node "
                    "its own folder (nodes may share a parent folder only for different models)"
                ) from None
            raise
        return handle

    def _rebuild(self) -> float:
        """The index from the folder's names, sizes and mtimes (least recently used first)."""
        start = time.monotonic()
        found: list[tuple[float, int, int]] = []  # (mtime, hash, size)
        for entry in self._entries():
            if time.monotonic() - start > SCAN_TIME_LIMIT_S:
                log.warning(
                    "kv offload: index rebuild stopped after %.0f s: %d blocks indexed",
                    SCAN_TIME_LIMIT_S,
                    len(found),
                )
                break
            block_hash = _hash_of(entry.name)
            if block_hash is None:
                self._skip_unknown(entry)
                continue
            stat = entry.stat()
            found.append((stat.st_mtime, block_hash, stat.st_size))
        with self._lock:
            for _, block_hash, size in sorted(found):
                self._index[block_hash] = size
                self.num_bytes += size
        self._evict_past_budget()
        return time.monotonic() - start

    def _entries(self):
        for sub in os.scandir(self.folder):
            if sub.is_dir(follow_symlinks=False):
                yield from os.scandir(sub.path)

    def _skip_unknown(self, entry: os.DirEntry) -> None:
        if entry.name.endswith(".tmp"):
            if time.time() - entry.stat().st_mtime > STALE_TEMP_S:  # a crashed writer's
                _unlink(entry.path)
            return
        self.counts.foreign += 1
        log.warning("kv offload: skipping %s: not a block of this namespace", entry.path)

    # ------------------------------------------------------------------ lookups
    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def touch(self, block_hashes: list[int]) -> None:
        """Recency, once per request: these blocks move to the back of the eviction order, on
        disk too (mtime), so the order survives a restart."""
        now = time.time()
        with self._lock:
            present = [h for h in block_hashes if h in self._index]
            for block_hash in present:
                self._index.move_to_end(block_hash)
        for block_hash in present:
            try:
                os.utime(self._path(block_hash), (now, now))
            except OSError:
                pass

    # ------------------------------------------------------------------ writes
    def store(self, block: StoredBlock) -> bool:
        """Write one block (a temporary file renamed into place); False when it was there already."""
        if block.block_hash in self:
            return False
        data = self._encode(block)
        path = self._path(block.block_hash)
        path.parent.mkdir(exist_ok=True)
        temp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        with open(temp, "wb") as f:
            f.write(data)
        os.replace(temp, path)
        with self._lock:
            if block.block_hash not in self._index:
                self._index[block.block_hash] = len(data)
                self.num_bytes += len(data)
            self.counts.stored += 1
        self._evict_past_budget()
        return True

    def _encode(self, block: StoredBlock) -> bytes:
        payload = block.payload.contiguous()
        raw = payload.view(torch.uint8).numpy().tobytes()
        header = msgpack.packb(
            {
                "namespace": self.namespace,
                "hash": block.block_hash,
                "tokens": list(block.token_ids),
                "shape": list(payload.shape),
                "dtype": str(payload.dtype).removeprefix("torch."),
                "checksum": xxhash.xxh3_64_intdigest(raw),
            }
        )
        return _PREFIX.pack(MAGIC, VERSION, len(header)) + header + raw

    def _evict_past_budget(self) -> None:
        while True:
            with self._lock:
                if self.num_bytes <= self.budget_bytes or not self._index:
                    return
                block_hash, size = self._index.popitem(last=False)
                self.num_bytes -= size
                self.counts.evicted += 1
            _unlink(self._path(block_hash))

    # ------------------------------------------------------------------ reads
    def load(self, block_hash: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        """The block's payload, checked; None when it is not there or fails a check (then the
        file is gone and the block is recomputed)."""
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(block_hash, missing=True)
            return None
        payload = self._decode(data, block_hash, token_ids)
        if payload is None:
            log.warning("kv offload: %s failed its check: deleted, the block is recomputed", path)
            self._forget(block_hash, corrupt=True)
            _unlink(path)
            return None
        with self._lock:
            self.counts.loaded += 1
        return payload

    def _decode(self, data: bytes, block_hash: int, token_ids: tuple[int, ...]) -> torch.Tensor | None:
        try:
            magic, version, size = _PREFIX.unpack_from(data)
            if magic != MAGIC or version != VERSION:
                return None
            start = _PREFIX.size + size
            header = msgpack.unpackb(data[_PREFIX.size : start])
            raw = memoryview(data)[start:]
            ok = (
                header["namespace"] == self.namespace
                and header["hash"] == block_hash
                and tuple(header["tokens"]) == tuple(token_ids)
                and header["checksum"] == xxhash.xxh3_64_intdigest(raw)
            )
            if not ok:
                return None
            dtype = getattr(torch, header["dtype"])
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(header["shape"])
        except (
            struct.error,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            RuntimeError,
            msgpack.UnpackException,
        ):
            return None

    def _forget(self, block_hash: int, missing: bool = False, corrupt: bool = False) -> None:
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.num_bytes -= size
            self.counts.missing += missing
            self.counts.corrupt += corrupt

    # ------------------------------------------------------------------ the rest
    def _path(self, block_hash: int) -> pathlib.Path:
        name = f"{block_hash:016x}"
        return self.folder / name[:2] / f"{name}{SUFFIX}"

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._index)

    def close(self) -> None:
        """Let go of the folder (another node may take it)."""
        self._lock_file.close()


def _hash_of(name: str) -> int | None:
    if not name.endswith(SUFFIX) or len(name) != 16 + len(SUFFIX):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
