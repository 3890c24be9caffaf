"""Which nodes serve a request: pure functions of node records and router-side bookkeeping.

Decode node: most free KV blocks net of what the router sent it since its last heartbeat
(``Outstanding``), counting the prompt blocks it already caches as free, then fewest running.
Prefill node (same fingerprint): least queued prefill tokens (plus those sent since its last
heartbeat) minus the prompt tokens it already caches.

Which node caches what is the router's own guess: ``PrefixMap`` remembers, per full-block
hash of recent prompts, the nodes they went to. Turns of a conversation share a prefix, so a
conversation stays on the same pair for as long as its cached tokens outweigh the load gap.

Conditional disaggregation: when fewer than ``disagg_threshold`` prompt tokens are left after
the decode node's cached prefix, the decode node prefills itself (no KV transfer).

Colocated nodes (role ``colocated``) prefill and decode every request they take themselves: they
compete with decode nodes for requests, never get KV sent to them, and never prefill for others.
With ``prefix_routing`` off the policy forgets what it sent where: routing by load alone.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

from engine.block_hash import hash_full_blocks
from protocol.fingerprint import KVFingerprint
from protocol.registry import NodeInfo, Role


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    decode: NodeInfo  # decodes (and prefills, when prefill is None)
    prefill: NodeInfo | None  # prefills and ships the KV to decode; None: no disaggregation
    block_hashes: tuple[int, ...]  # the prompt's full-block hashes at the pair's block size
    num_blocks: int  # blocks the prompt and its output may take on the decode node


class PrefixMap:
    """LRU map of block hash → ids of the nodes a prompt with that block went to."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._capacity = capacity
        self._hash_to_node_ids: collections.OrderedDict[int, set[str]] = collections.OrderedDict()

    def record(self, block_hashes: Sequence[int], node_id: str) -> None:
        for block_hash in block_hashes:
            self._hash_to_node_ids.setdefault(block_hash, set()).add(node_id)
            self._hash_to_node_ids.move_to_end(block_hash)
        while len(self._hash_to_node_ids) > self._capacity:
            self._hash_to_node_ids.popitem(last=False)

    def num_cached_blocks(self, block_hashes: Sequence[int], node_id: str) -> int:
        """Leading blocks of the prompt that ``node_id`` was last seen to hold."""
        num = 0
        for block_hash in block_hashes:
            if node_id not in self._hash_to_node_ids.get(block_hash, ()):
                break
            num += 1
        return num


@dataclasses.dataclass(slots=True)
class _Sent:
    node_id: str
    sent_time: float  # wall clock when the request went out
    num_blocks: int  # decode node: blocks it will take
    num_prefill_tokens: int  # prefill node: tokens it has to compute


class Outstanding:
    """Requests sent to nodes that their last heartbeat may not account for yet."""

    def __init__(self) -> None:
        self._sent: dict[tuple[str, str], _Sent] = {}  # (request id, node id) -> what was sent

    def add(
        self, request_id: str, node_id: str, now: float, num_blocks: int = 0, num_prefill_tokens: int = 0
    ) -> None:
        self._sent[(request_id, node_id)] = _Sent(node_id, now, num_blocks, num_prefill_tokens)

    def remove(self, request_id: str) -> None:
        for key in [key for key in self._sent if key[0] == request_id]:
            del self._sent[key]

    def _since_heartbeat(self, node: NodeInfo) -> list[_Sent]:
        return [
            s for s in self._sent.values() if s.node_id == node.node_id and s.sent_time > node.heartbeat_time
        ]

    def num_blocks(self, node: NodeInfo) -> int:
        return sum(s.num_blocks for s in self._since_heartbeat(node))

    def num_prefill_tokens(self, node: NodeInfo) -> int:
        return sum(s.num_prefill_tokens for s in self._since_heartbeat(node))


def fingerprint_key(node: NodeInfo) -> KVFingerprint:
    """Nodes pair only when these are equal."""
    return node.fingerprint


class RoutingPolicy:
    def __init__(
        self, disagg_threshold: int, prefix_capacity: int = 1 << 16, prefix_routing: bool = True
    ) -> None:
        self.disagg_threshold = disagg_threshold  # fewer uncached prompt tokens: prefill on decode
        self.prefix_routing = prefix_routing  # False: never record prefixes, so routing sees no cache
        self.prefill_prefixes = PrefixMap(prefix_capacity)
        self.decode_prefixes = PrefixMap(prefix_capacity)
        self.outstanding = Outstanding()

    def choose(
        self,
        nodes: Sequence[NodeInfo],
        prompt_ids: Sequence[int],
        max_tokens: int,
        exclude: frozenset[str] = frozenset(),
        disaggregate: bool = True,
    ) -> Route | None:
        """The best pair for this prompt, or None when no decode node can take it. ``disaggregate``
        False: the decode node alone (a migrated request, which resumes mid-output)."""
        usable = [
            n
            for n in nodes
            if not n.draining and n.node_id not in exclude and n.max_model_len >= len(prompt_ids) + max_tokens
        ]
        decodes = [n for n in usable if n.role.decodes]
        if not decodes:
            return None
        hashes_by_size: dict[int, tuple[int, ...]] = {}

        def hashes(node: NodeInfo) -> tuple[int, ...]:
            size = _block_size(node)
            if size not in hashes_by_size:
                hashes_by_size[size] = tuple(hash_full_blocks(prompt_ids, size))
            return hashes_by_size[size]

        def decode_key(node: NodeInfo) -> tuple[int, int, str]:
            cached = self.decode_prefixes.num_cached_blocks(hashes(node), node.node_id)
            free = node.num_blocks_free - self.outstanding.num_blocks(node) + cached
            return (-free, node.num_running, node.node_id)

        def colocated_key(node: NodeInfo) -> tuple:
            # It prefills the prompt itself, so the prompt waits for the node's queue of prompt
            # tokens, less the ones its cache spares; then free blocks, as for a decode node.
            cached = self.decode_prefixes.num_cached_blocks(hashes(node), node.node_id) * _block_size(node)
            queued = node.num_queued_prefill_tokens + self.outstanding.num_prefill_tokens(node)
            return (queued - cached, *decode_key(node))

        colocated = all(n.role is Role.COLOCATED for n in decodes)
        decode = min(decodes, key=colocated_key if colocated else decode_key)
        block_hashes = hashes(decode)
        size = _block_size(decode)
        num_blocks = math.ceil((len(prompt_ids) + max_tokens) / size)
        num_cached = self.decode_prefixes.num_cached_blocks(block_hashes, decode.node_id) * size
        prefill = None
        if (
            disaggregate
            and decode.role is not Role.COLOCATED
            and len(prompt_ids) - num_cached >= self.disagg_threshold
        ):
            prefill = self._choose_prefill(usable, decode, block_hashes)
        return Route(decode, prefill, block_hashes, num_blocks)

    def _choose_prefill(
        self, usable: Sequence[NodeInfo], decode: NodeInfo, block_hashes: tuple[int, ...]
    ) -> NodeInfo | None:
        key = fingerprint_key(decode)
        prefills = [n for n in usable if n.role is Role.PREFILL and fingerprint_key(n) == key]
        size = _block_size(decode)

        def prefill_key(node: NodeInfo) -> tuple[int, int, str]:
            cached = self.prefill_prefixes.num_cached_blocks(block_hashes, node.node_id) * size
            queued = node.num_queued_prefill_tokens + self.outstanding.num_prefill_tokens(node)
            return (queued - cached, node.num_queued, node.node_id)

        return min(prefills, key=prefill_key, default=None)

    def record(self, request_id: str, route: Route, num_prompt_tokens: int, now: float) -> None:
        """Book-keep a request just sent along ``route`` (until ``finish``)."""
        self.outstanding.add(
            request_id,
            route.decode.node_id,
            now,
            num_blocks=route.num_blocks,
            num_prefill_tokens=0 if route.prefill else num_prompt_tokens,
        )
        if route.prefill is not None:
            self.outstanding.add(request_id, route.prefill.node_id, now, num_prefill_tokens=num_prompt_tokens)

    def remember_prefix(self, route: Route) -> None:
        """The prompt was computed along ``route`` (its first token came): both nodes now cache it."""
        if not self.prefix_routing:
            return
        self.decode_prefixes.record(route.block_hashes, route.decode.node_id)
        if route.prefill is not None:
            self.prefill_prefixes.record(route.block_hashes, route.prefill.node_id)

    def finish(self, request_id: str) -> None:
        self.outstanding.remove(request_id)


def _block_size(node: NodeInfo) -> int:
    return node.fingerprint.block_size
