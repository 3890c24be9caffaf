"""Node records in Redis: one hash per node, refreshed by heartbeats, gone when they stop.

    key  pdserve:node:<node_id>   (hash, TTL = heartbeat ttl; each heartbeat rewrites it and its TTL)

A node that dies stops refreshing and its key expires; a node that drains deletes its key.
Under a cluster key (protocol/cluster_key.py) every record carries a MAC, and a reader with the
key takes no record without a valid one; a reader that polls also refuses signed records that are
replayed (ReplayGuard). Torch-free: the router reads these records.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import threading
import time

from pdserve.protocol import codec
from pdserve.protocol.cluster_key import MAC_FIELD, record_mac, record_problem
from pdserve.protocol.fingerprint import KVFingerprint

KEY_PREFIX = "pdserve:node:"
VERSION_FIELD = "protocol_version"  # every record's first check: the wire version its node speaks


# Upper bounds (seconds) of a node's step-time buckets in NodeInfo.step_stats (+Inf is the step
# count): the engine counts into them, the router exports them as a histogram.
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Role(enum.StrEnum):
    PREFILL = "prefill"  # computes prompts and ships their KV to a decode node
    DECODE = "decode"  # decodes prompts whose KV it received, and prefills short ones itself
    COLOCATED = "colocated"  # prefills and decodes everything it takes; the router never sends it KV

    @property
    def decodes(self) -> bool:
        """A request's decode (and a local prefill) can go to it."""
        return self is not Role.PREFILL


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    node_id: str  # unique per process, e.g. "decode-<host>-<pid>-<random>"
    role: Role
    control_addr: str  # ZeroMQ address for GenerateRequest / AbortRequest
    kv_addr: str | None  # decode nodes: address of the KV receiver; None on prefill nodes
    fingerprint: KVFingerprint  # only nodes with equal ones are paired
    max_model_len: int  # longest prompt + output the node accepts
    num_blocks_total: int  # KV blocks in the pool
    num_blocks_free: int  # blocks no request holds (cached ones included)
    num_blocks_cached: int  # free blocks that still serve prefix hits (evictable)
    num_running: int  # requests in the running batch
    num_queued: int  # requests waiting (for blocks, KV or a slot)
    num_queued_prefill_tokens: int  # prompt tokens not yet computed
    draining: bool = False  # finishing in-flight work, takes no new requests
    # prompt tokens computed per second of engine step, a recent average of its steps of many prompt
    # tokens (engine.step_stats.PrefillRate); None until the node has run one
    prefill_tokens_per_s: float | None = None
    device: str = "cpu"  # the torch device the node's engine computes on (rank 0's)
    tp_size: int = 1  # tensor-parallel ranks the node's model is split over (its layout)
    integrity_error: str | None = None  # a failed invariant check: the node stopped serving (see its log)
    # engine steps by kind, counted from the node's start: engine.step_stats.StepStats.snapshot(),
    # each kind's step-time counts bucketed by STEP_BUCKETS_S
    step_stats: dict[str, dict] = dataclasses.field(default_factory=dict)
    # blocks whose memory is committed (engine.kv_prefault: the CPU pool commits as it is used,
    # or while the node is idle); None from a node that does not say
    num_blocks_committed: int | None = None
    # torch threads the engine computes with now (engine.cpu_share: fewer while other processes
    # load the node's CPUs); None from a node that does not say
    torch_threads: int | None = None
    # the node's step-time target for steps that compute prompt tokens (engine.step_budget): a
    # running decode's time per token while the node prefills a prompt; None until measured
    step_target_s: float | None = None
    # speculative decoding since the node's start: proposed_tokens, accepted_tokens and drafted_steps
    # (engine.speculation.SpecStats); None where it is off or the node does not say
    speculation: dict[str, int] | None = None
    # the KV offload tier's counts since the node's start (engine/offload/tiers.py OffloadStats:
    # blocks and bytes in its folder, stored, loaded, skipped, corrupt, timed out, evicted); None
    # where it has none or the node does not say
    kv_offload: dict[str, int] | None = None
    # LoRA: the largest adapter rank the node's slots hold (--max-lora-rank); None where adapters
    # are off. The adapters in its slots now, and per adapter the requests it took, the times it
    # read one into a slot and the times one was evicted for another (its /metrics, through the router)
    max_lora_rank: int | None = None
    adapters: tuple[str, ...] = ()
    adapter_counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    heartbeat_time: float = 0.0  # wall clock of this record

    def to_redis(self) -> dict[str, str]:
        record = dataclasses.asdict(self)  # the fingerprint as a map; the role as its string
        record[VERSION_FIELD] = codec.PROTOCOL_VERSION
        return {name: json.dumps(value) for name, value in record.items()}

    @classmethod
    def from_redis(cls, raw: dict[bytes | str, bytes | str]) -> NodeInfo:
        """A record written by ``to_redis`` of this protocol version (``codec.VersionMismatch``,
        naming the node, for another); fields this version does not know are ignored, and a
        record it cannot read raises TypeError or ValueError."""
        fields = {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}
        version = fields.pop(VERSION_FIELD, None)
        if version != codec.PROTOCOL_VERSION or isinstance(version, bool):
            raise codec.VersionMismatch("registry record", version, codec.sender_of(fields))
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in fields.items() if k in names}
        if not isinstance(known.get("fingerprint"), dict):
            raise ValueError("record has no fingerprint")
        known["fingerprint"] = KVFingerprint(**known["fingerprint"])
        if not isinstance(known.get("role"), str):
            raise ValueError("record has no role")
        known["role"] = Role(known["role"])
        if "adapters" in known:  # JSON's list, as the tuple it was
            known["adapters"] = tuple(known["adapters"])
        return cls(**known)


def connect(url: str, password_file: str | None = None, **options):
    """A Redis client for ``url``; the password from ``password_file`` when given (a mounted
    secret), else whatever the URL carries (``redis://:PASSWORD@host:6379/0``)."""
    import redis

    if password_file:
        with open(password_file) as f:
            options["password"] = f.read().strip()
    return redis.Redis.from_url(url, **options)


# Heartbeat stamps never go back (an NTP step back would otherwise make a node's own records look
# replayed) and follow the wall clock forward: a machine paused, then stepped ahead (a VM resumed),
# must not stamp from its old time, or a reader started after the step would take its records for
# stale captures. A step back is absorbed: stamps go on at the monotonic clock's pace from the last.
_wall_clock = time.time  # the machine's wall clock (a test gives a node a skewed one)
_stamp_lock = threading.Lock()
_last_stamp: tuple[float, float] = (time.time(), time.monotonic())  # (stamp, monotonic clock then)


def heartbeat_clock() -> float:
    global _last_stamp
    with _stamp_lock:
        stamp, at = _last_stamp
        now = time.monotonic()
        stamp = max(_wall_clock(), stamp + (now - at))
        _last_stamp = (stamp, now)
        return stamp


def publish(client, info: NodeInfo, ttl_s: float, key: bytes | None = None) -> None:
    """Write (or refresh) a node's record with a TTL, atomically; signed when given the cluster key."""
    redis_key = KEY_PREFIX + info.node_id
    fields = dataclasses.replace(info, heartbeat_time=heartbeat_clock()).to_redis()
    if key is not None:
        fields[MAC_FIELD] = record_mac(key, redis_key, fields)
    pipe = client.pipeline(transaction=True)
    pipe.delete(redis_key)
    pipe.hset(redis_key, mapping=fields)
    pipe.pexpire(redis_key, max(1, int(ttl_s * 1000)))
    pipe.execute()


def withdraw(client, node_id: str) -> None:
    client.delete(KEY_PREFIX + node_id)


def list_nodes(client, key: bytes | None = None, refused: list[str] | None = None) -> list[NodeInfo]:
    """Every live node record (expired ones are gone already). With the cluster key, only those
    signed under it; each record left out for that, or for its protocol version, is said in
    ``refused``."""
    nodes = []
    for redis_key in client.scan_iter(match=KEY_PREFIX + "*", count=100):
        raw = client.hgetall(redis_key)
        if not raw:
            continue
        name = redis_key.decode() if isinstance(redis_key, bytes) else redis_key
        fields = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        problem = None if key is None else record_problem(key, name, fields)
        if problem is not None:
            if refused is not None:
                refused.append(f"{name}: {problem}")
            continue
        fields.pop(MAC_FIELD, None)
        try:
            nodes.append(NodeInfo.from_redis(fields))
        except codec.VersionMismatch as exc:
            if refused is not None:
                refused.append(f"{name}: {exc}")
        except (TypeError, ValueError):
            continue  # a record that cannot be read: ignore rather than crash
    return sorted(nodes, key=lambda n: n.node_id)


class ReplayGuard:
    """Refuses signed records that a writer with Redis access but no key copied and wrote back.

    A MAC proves who wrote a record, not when; the signed ``heartbeat_time`` does, without trusting
    that the writer's and reader's clocks agree more than loosely. Every publish stamps anew, and
    a node's stamps never go back (``heartbeat_clock``), so:
    - a record older than the newest one seen of that node is a replay (of a live node's past);
    - the newest one seen, back after its key had gone, is a replay of a node that left (the
      newest stamps outlive their keys);
    - a node seen for the first time must have beaten within ``max_age_s`` of the reader's wall
      clock, its allowance for clock skew between machines: an old capture of a node that left
      before this reader started is refused by it. A live node is never dropped for skew: the
      check is made once per node.
    """

    MAX_NODES = 4096  # newest stamps kept, the node seen longest ago forgotten first

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._newest: collections.OrderedDict[str, float] = collections.OrderedDict()

    def check(self, node: NodeInfo, now: float, listed_before: bool) -> str | None:
        """Why ``node``'s record is refused (None: taken). ``now`` is the reader's wall clock;
        ``listed_before``: the reader's previous poll took a record of this node."""
        newest = self._newest.get(node.node_id)
        if newest is None:
            behind = now - node.heartbeat_time
            if behind > self.max_age_s:
                return (
                    f"replayed or stale: its heartbeat is {behind:.0f}s behind this clock "
                    f"(more than the {self.max_age_s:g}s allowed for skew)"
                )
        elif node.heartbeat_time < newest:
            return (
                f"replayed: its heartbeat is {newest - node.heartbeat_time:.3f}s older than one seen before"
            )
        elif node.heartbeat_time == newest and not listed_before:
            return "replayed: the node's last record, written back after its key had gone"
        else:
            self._newest.move_to_end(node.node_id)
        self._newest[node.node_id] = node.heartbeat_time
        while len(self._newest) > self.MAX_NODES:
            self._newest.popitem(last=False)
        return None
