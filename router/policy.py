"""Which nodes serve a request: pure functions of node records and router-side bookkeeping.

Decode node: most free KV blocks net of what the router sent it since its last heartbeat
(``Outstanding``), counting the prompt blocks it already caches as free, then fewest running.
Prefill node (same fingerprint): least queued prefill tokens (plus those sent since its last
heartbeat) minus the prompt tokens it already caches.

Which node caches what is the router's own guess: ``PrefixMap`` remembers, per full-block
hash of recent prompts, the nodes they went to. Turns of a conversation share a prefix, so a
conversation stays on the same pair for as long as its cached tokens outweigh the load gap.

Conditional disaggregation: when fewer than ``disagg_threshold`` prompt tokens are left after
the decode node's cached prefix, the decode node prefills itself (no KV transfer). It also does
when the prefill pool is backed up: when the prompt would wait ``local_prefill_margin_s`` longer
behind the shortest prefill queue than behind the decode node's own queue of prompts, both at the
prefill node's measured speed. The margin is how much longer a prompt may wait for the prefill
pool before the decode node's running requests pay for prefilling it in their steps; below 0,
never. What they pay is bounded on the node, not here: its steps keep to their step-time target
(engine.step_budget) by chunking the prompt, and a chunk leaves a token of each step to every
running decode (engine.scheduler), so a local prefill stretches the decodes' time per token to at
most the target while its chunks run, and never holds them out of a step.

A decode node that has requests running prefills a long prompt only under a TPOT SLO
(``tpot_slo_s``), and only when its step-time target is within it: its steps stretch to that target
while it does. Without one only an idle decode node does, so that no prompt slows running decodes.
With a TTFT SLO the router sheds (429) a new request whose predicted first token, its prefilling
node's prompt queue at that node's speed (``predicted_ttft_s``), would come later; without one,
one predicted past the chunk timeout, which it would abort and retry (admission.py).

Colocated nodes (role ``colocated``) prefill and decode every request they take themselves: they
compete with decode nodes for requests, never get KV sent to them, and never prefill for others.
With ``prefix_routing`` off the policy forgets what it sent where: routing by load alone.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from pdserve.protocol.block_hash import hash_full_blocks
from pdserve.protocol.fingerprint import KVFingerprint
from pdserve.protocol.registry import NodeInfo, Role

T = TypeVar("T")


class Placement(enum.StrEnum):
    """Where a prompt is prefilled and why (the routes metric's ``prefill`` label)."""

    PREFILL_NODE = "prefill_node"  # disaggregated: a prefill node ships the KV
    COLOCATED = "colocated"  # the decode pool prefills and decodes itself
    RESUMED = "resumed"  # a migrated sample: the decode node recomputes its prompt and output
    SHORT = "short"  # below the threshold once cache hits are spared
    NO_PREFILL_NODE = "no_prefill_node"  # none usable
    BACKED_UP = "backed_up"  # the prefill pool's queue is longer by more than the margin


def place(
    *,
    colocated: bool,
    disaggregate: bool,
    num_uncached_tokens: int,
    threshold: int,
    find_prefill: Callable[[], T | None],
    backed_up: Callable[[T], bool],
) -> tuple[T | None, Placement]:
    """The placement rule, the router's and the planner's simulation's alike: where a prompt is
    prefilled. ``find_prefill``: the prefill node it would go to (None: none usable);
    ``backed_up``: whether it would wait longer there than on its decode node by the margin."""
    if colocated:
        return None, Placement.COLOCATED
    if not disaggregate:
        return None, Placement.RESUMED
    if num_uncached_tokens < threshold:
        return None, Placement.SHORT
    prefill = find_prefill()
    if prefill is None:
        return None, Placement.NO_PREFILL_NODE
    if backed_up(prefill):
        return None, Placement.BACKED_UP  # the decode node prefills it
    return prefill, Placement.PREFILL_NODE


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    decode: NodeInfo  # decodes (and prefills, when prefill is None)
    prefill: NodeInfo | None  # prefills and ships the KV to decode; None: no disaggregation
    block_hashes: tuple[int, ...]  # the prompt's full-block hashes at the pair's block size
    num_blocks: int  # blocks the prompt and its output may take on the decode node
    placement: Placement = Placement.PREFILL_NODE


class PrefixMap:
    """LRU map of block hash → the nodes a prompt with that block went to, each with when (its
    count of blocks recorded then), so that a node's tiers can be told apart: a node's pool holds
    about its ``num_blocks_total`` most recently used blocks; a node with an offload tier
    (engine/offload/, ``NodeInfo.kv_offload``) holds the older ones there, one without has let
    them go."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._capacity = capacity
        # block hash -> {node id: that node's recorded-block count when it last took the block}
        self._hash_to_nodes: collections.OrderedDict[int, dict[str, int]] = collections.OrderedDict()
        self._num_recorded: collections.Counter[str] = collections.Counter()  # per node

    def record(self, block_hashes: Sequence[int], node_id: str) -> None:
        # last to first: a node frees a prompt's blocks tail first, so its pool evicts the tail
        # first and keeps the leading blocks longest; they count as the most recent here too
        for block_hash in reversed(block_hashes):
            self._num_recorded[node_id] += 1
            self._hash_to_nodes.setdefault(block_hash, {})[node_id] = self._num_recorded[node_id]
        for block_hash in block_hashes:  # the map's own LRU order (capacity), prompt order
            self._hash_to_nodes.move_to_end(block_hash)
        while len(self._hash_to_nodes) > self._capacity:
            self._hash_to_nodes.popitem(last=False)

    def num_cached_blocks(self, block_hashes: Sequence[int], node_id: str) -> int:
        """Leading blocks of the prompt that ``node_id`` was last seen to hold, in any tier."""
        return sum(self.cached_blocks(block_hashes, node_id, None))

    def cached_blocks(
        self, block_hashes: Sequence[int], node_id: str, pool_blocks: int | None
    ) -> tuple[int, int]:
        """(in its pool, in its offload tier): the leading blocks of the prompt ``node_id`` holds,
        those among the last ``pool_blocks`` it took counted in its pool (None: all of them)."""
        newest = self._num_recorded[node_id]
        pool = tier = 0
        for block_hash in block_hashes:
            when = self._hash_to_nodes.get(block_hash, {}).get(node_id)
            if when is None:
                break
            if pool_blocks is None or (tier == 0 and newest - when < pool_blocks):
                pool += 1
            else:
                tier += 1
        return pool, tier


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


DEFAULT_TIER_LOAD_SHARE = 0.1  # a tier block's load, as a share of computing it, until a node says


def tier_load_share(node: NodeInfo) -> float:
    """What loading a block from ``node``'s offload tier costs, as a share of computing it: its
    measured prefill speed over its tier's measured load speed (engine/offload/tiers.py)."""
    counts = node.kv_offload or {}
    read, load_us = counts.get("read_blocks", 0), counts.get("load_us", 0)
    if not (read and load_us and node.prefill_tokens_per_s):
        return DEFAULT_TIER_LOAD_SHARE
    load_tokens_per_s = read * _block_size(node) / (load_us / 1e6)
    return min(1.0, node.prefill_tokens_per_s / load_tokens_per_s)


def fingerprint_key(node: NodeInfo) -> KVFingerprint:
    """Nodes pair only when these are equal."""
    return node.fingerprint


class RoutingPolicy:
    def __init__(
        self,
        disagg_threshold: int,
        prefix_capacity: int = 1 << 16,
        prefix_routing: bool = True,
        local_prefill_margin_s: float = -1.0,  # the router passes its config's (on by default)
        tpot_slo_s: float | None = None,  # a busy decode node prefills locally only within it
    ) -> None:
        self.disagg_threshold = disagg_threshold  # fewer uncached prompt tokens: prefill on decode
        self.local_prefill_margin_s = local_prefill_margin_s  # see the module's docstring; < 0: off
        self.tpot_slo_s = tpot_slo_s
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
        cache_root: int | None = None,
        adapter: tuple[str, int] | None = None,
    ) -> Route | None:
        """The best pair for this prompt, or None when no decode node can take it. ``disaggregate``
        False: the decode node alone (a migrated request, which resumes mid-output). ``cache_root``:
        where the prompt's hash chain starts (its adapter's and cache salt's, protocol.block_hash),
        as on the nodes: a prefix cached under other keys is no prefix of it. ``adapter``: (name,
        rank) of its LoRA adapter: only nodes whose slots hold that rank serve it, and those with it
        in a slot already come first, unless they are busier (``_adapter_penalty``)."""
        usable = [n for n in nodes if _usable(n, exclude, len(prompt_ids) + max_tokens, adapter)]
        decodes = [n for n in usable if n.role.decodes]
        if not decodes:
            return None
        decode, block_hashes = self._choose_decode(decodes, prompt_ids, cache_root, adapter)
        size = _block_size(decode)
        num_cached = self.decode_prefixes.num_cached_blocks(block_hashes, decode.node_id) * size
        # unpacked where it is called, mypy would solve place's T from the targets as NodeInfo | None
        placed = place(
            colocated=decode.role is Role.COLOCATED,
            disaggregate=disaggregate,
            num_uncached_tokens=len(prompt_ids) - num_cached,
            threshold=self.disagg_threshold,
            find_prefill=lambda: self._choose_prefill(usable, decode, block_hashes, adapter),
            backed_up=lambda p: self._backed_up(p, decode, block_hashes, len(prompt_ids)),
        )
        prefill, placement = placed
        num_blocks = math.ceil((len(prompt_ids) + max_tokens) / size)
        return Route(decode, prefill, block_hashes, num_blocks, placement)

    def _choose_decode(
        self,
        decodes: Sequence[NodeInfo],
        prompt_ids: Sequence[int],
        cache_root: int | None,
        adapter: tuple[str, int] | None,
    ) -> tuple[NodeInfo, tuple[int, ...]]:
        """The decode node with the most room (colocated ones: the shortest prompt queue first),
        and the prompt's block hashes at its block size."""
        hashes_by_size: dict[int, tuple[int, ...]] = {}

        def hashes(node: NodeInfo) -> tuple[int, ...]:
            size = _block_size(node)
            if size not in hashes_by_size:
                hashes_by_size[size] = tuple(hash_full_blocks(prompt_ids, size, parent_hash=cache_root))
            return hashes_by_size[size]

        def decode_key(node: NodeInfo) -> tuple[float, int, str]:
            cached = self.decode_prefixes.num_cached_blocks(hashes(node), node.node_id)
            free: float = node.num_blocks_free - self.outstanding.num_blocks(node) + cached
            free -= _adapter_penalty(node, adapter) * ADAPTER_LOAD_BLOCK_SHARE * node.num_blocks_total
            return (-free, node.num_running, node.node_id)

        def colocated_key(node: NodeInfo) -> tuple:
            # It prefills the prompt itself, so the prompt waits for the node's queue of prompt
            # tokens, less the ones its cache spares; then free blocks, as for a decode node.
            queued = self._prompt_queue(node, self.decode_prefixes, hashes(node), 0)
            return (queued + _adapter_penalty(node, adapter) * ADAPTER_LOAD_TOKENS, *decode_key(node))

        colocated = all(n.role is Role.COLOCATED for n in decodes)
        decode = min(decodes, key=colocated_key if colocated else decode_key)
        return decode, hashes(decode)

    def _backed_up(
        self, prefill: NodeInfo, decode: NodeInfo, block_hashes: tuple[int, ...], num_prompt_tokens: int
    ) -> bool:
        """The prompt would wait more than the margin longer for ``prefill`` than for ``decode``,
        and ``decode``'s running requests can afford it (``local_prefill_fits``)."""
        speed = prefill.prefill_tokens_per_s
        if self.local_prefill_margin_s < 0 or not speed:
            return False  # off, or no speed measured yet to turn tokens into seconds
        if not self.local_prefill_fits(decode):
            return False
        remote = self._prompt_queue(prefill, self.prefill_prefixes, block_hashes, num_prompt_tokens)
        local = self._prompt_queue(decode, self.decode_prefixes, block_hashes, num_prompt_tokens)
        return (remote - local) / speed > self.local_prefill_margin_s

    def local_prefill_fits(self, decode: NodeInfo) -> bool:
        """Whether ``decode`` may prefill a long prompt beside its running requests: while it does,
        its steps run to its step-time target, each running request's time per token with them,
        so that target must be within the TPOT SLO. Without one, never: what disaggregation
        promises is decodes that no prompt slows (bench/notes/serving.md, "PD past capacity").
        An idle node may always."""
        if decode.num_running == 0:
            return True
        if self.tpot_slo_s is None:
            return False
        return decode.step_target_s is not None and decode.step_target_s <= self.tpot_slo_s

    def predicted_ttft_s(
        self, route: Route, num_prompt_tokens: int, nodes: Sequence[NodeInfo] = ()
    ) -> float | None:
        """Seconds until the prompt's first token along ``route``: the prompt queue of the node that
        prefills it (its last report, what was sent since, this prompt, less its cached prefix) at
        that node's measured prefill speed, or the mean of the speeds ``nodes`` measured. With no
        speed anywhere (a cluster that just started): None (admit) while the node's queue is
        empty, else infinity: prompts stacked behind a speed nobody knows are what melts a cold
        cluster under a burst."""
        node = route.prefill or route.decode
        prefixes = self.prefill_prefixes if route.prefill is not None else self.decode_prefixes
        queued = self._prompt_queue(node, prefixes, route.block_hashes, num_prompt_tokens)
        speeds = [n.prefill_tokens_per_s for n in nodes if n.prefill_tokens_per_s]
        speed = node.prefill_tokens_per_s or (sum(speeds) / len(speeds) if speeds else None)
        if speed:
            return queued / speed
        return None if queued <= num_prompt_tokens else math.inf

    def _prompt_queue(
        self, node: NodeInfo, prefixes: PrefixMap, block_hashes: tuple[int, ...], num_prompt_tokens: int
    ) -> float:
        """Prompt tokens ``node`` has queued (its last report plus what was sent since), with
        ``num_prompt_tokens`` more on top, less the prompt tokens its cache would spare: all of
        those in its pool, and of those in its offload tier what loading them saves over
        computing them (``tier_load_share``)."""
        pool_blocks = node.num_blocks_total if node.kv_offload else None
        pool, tier = prefixes.cached_blocks(block_hashes, node.node_id, pool_blocks)
        cached = (pool + tier * (1.0 - tier_load_share(node))) * _block_size(node)
        queued = node.num_queued_prefill_tokens + self.outstanding.num_prefill_tokens(node)
        return queued + num_prompt_tokens - cached

    def _choose_prefill(
        self,
        usable: Sequence[NodeInfo],
        decode: NodeInfo,
        block_hashes: tuple[int, ...],
        adapter: tuple[str, int] | None = None,
    ) -> NodeInfo | None:
        key = fingerprint_key(decode)
        prefills = [n for n in usable if n.role is Role.PREFILL and fingerprint_key(n) == key]

        def prefill_key(node: NodeInfo) -> tuple[float, int, str]:
            queued = self._prompt_queue(node, self.prefill_prefixes, block_hashes, 0)
            return (
                queued + _adapter_penalty(node, adapter) * ADAPTER_LOAD_TOKENS,
                node.num_queued,
                node.node_id,
            )

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


# A node without the request's adapter in a slot reads it first: routing counts that as this much
# more of a prefill queue, or this share of a decode node's blocks fewer free (loading an adapter of
# SmolLM2-135M's size costs about what prefilling a few hundred tokens does: bench/README.md).
ADAPTER_LOAD_TOKENS = 256
ADAPTER_LOAD_BLOCK_SHARE = 0.1


def _usable(
    node: NodeInfo, exclude: frozenset[str], num_tokens: int, adapter: tuple[str, int] | None
) -> bool:
    """Whether ``node`` may take a request of ``num_tokens`` (prompt and output) with ``adapter``."""
    return (
        not node.draining
        and node.node_id not in exclude
        and node.max_model_len >= num_tokens
        and can_hold(node, adapter)
    )


def can_hold(node: NodeInfo, adapter: tuple[str, int] | None) -> bool:
    """Whether ``node`` can run requests with ``adapter`` (name, rank): its slots hold that rank."""
    return adapter is None or (node.max_lora_rank is not None and node.max_lora_rank >= adapter[1])


def _adapter_penalty(node: NodeInfo, adapter: tuple[str, int] | None) -> float:
    """1 where the node would have to read the adapter first, 0 where it holds it or none is asked.
    Times ADAPTER_LOAD_TOKENS or ADAPTER_LOAD_BLOCK_SHARE, what that load weighs in routing."""
    return 0.0 if adapter is None or adapter[0] in node.adapters else 1.0


def _block_size(node: NodeInfo) -> int:
    return node.fingerprint.block_size
