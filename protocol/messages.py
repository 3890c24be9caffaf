"""Router <-> node messages (not KV: that is kv_transfer's protocol).

Same wire shape and strict decoding as ``kv_transfer.messages``: one msgpack header frame
``[version, tag, {fields}]``, never pickle. Flows:

    router ──GenerateRequest──► prefill node (decode_addr set: prefill, ship KV, report first token)
    router ──GenerateRequest──► decode node  (decode_addr None: prefill locally, then decode)
    node   ──TokenChunk───────► router's reply_addr (first token from P; the rest from D)
    node   ──RequestFailed────► router's reply_addr (the request ended in error)
    router ──AbortRequest─────► any node holding the request
    router ──SetRole──────────► a node: serve another role (node.host); RoleChange answers
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import ClassVar

import msgpack

from pdserve.protocol import codec
from pdserve.protocol.reasons import FailureCode, FinishReason
from pdserve.protocol.registry import NodeInfo, Role
from pdserve.protocol.sampling_params import SamplingParams

Message = codec.Message
ProtocolError = codec.ProtocolError


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TokenLogprobs:
    """One generated token's log-probability and its top alternatives."""

    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]  # most likely first
    top_logprobs: tuple[float, ...]  # same order as top_token_ids
    rank: int | None = None  # prompt tokens: 1 + how many tokens were more likely


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BeamOutput:
    """One more finished beam of a beam-search request (TokenChunk.beams)."""

    token_ids: tuple[int, ...]  # its whole output
    logprobs: tuple[TokenLogprobs, ...]  # one per token when asked for, else empty
    finish_reason: FinishReason


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StageTimings:
    """Where a request's time went on the nodes, each stage set by the node that saw it (None where
    the request did not pass through it); the router observes them in its stage histogram."""

    prefill_queue: float | None = None  # seconds waiting for a prompt's first step on the node that ran it
    prefill_compute: float | None = None  # seconds from that first step to the first token
    transfer: float | None = None  # seconds from the prefill node's shipping to the KV's landing
    decode_queue: float | None = None  # seconds from the KV's landing to the request's first decode step
    decode: float | None = None  # seconds the decode node held the request, landing to the end
    kv_bytes: int | None = None  # KV bytes the decode node received for it

    def seconds(self) -> dict[str, float]:
        """The stages passed through, by name (kv_bytes is a size, not a stage)."""
        return {
            f.name: value
            for f in dataclasses.fields(self)
            if f.name != "kv_bytes" and (value := getattr(self, f.name)) is not None
        }

    def known(self) -> dict[str, float | int]:
        """Every field that is set: a node adds its own stages to these with dataclasses.replace."""
        return {
            f.name: value for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None
        }


# W3C Trace Context's traceparent, version 00: version-trace id-parent span id-flags, lower-case hex
_TRACEPARENT = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
MAX_TRACESTATE_CHARS = 512  # W3C: 32 entries at most; vendors keep theirs short


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TraceContext:
    """The W3C trace context a request's spans on a node hang under (protocol/tracing.py): the
    router's attempt span, or the client's own context when the router does not trace. Checked
    on construction, so a malformed one from a peer is a ProtocolError, never a broken trace."""

    traceparent: str  # "00-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>"
    tracestate: str = ""  # vendors' entries, passed on untouched

    def __post_init__(self) -> None:
        if not _TRACEPARENT.fullmatch(self.traceparent):
            raise ValueError(f"traceparent {self.traceparent[:80]!r} is not a W3C version-00 traceparent")
        if len(self.tracestate) > MAX_TRACESTATE_CHARS:
            raise ValueError(f"tracestate longer than {MAX_TRACESTATE_CHARS} characters")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RequestMeta:
    """What a decode node needs of a prefilled request besides its prompt and KV; it rides in
    ``kv_transfer.messages.KVReserve``, which does not look inside."""

    reply_addr: str  # the router's PUSH address for this request's tokens
    deadline: float  # wall clock by which the request must be over (GenerateRequest.deadline)
    shipped_at: float  # the prefill node's wall clock when the transfer began (transfer time)
    timings: StageTimings = StageTimings()  # the prefill node's stages
    trace: TraceContext | None = None  # GenerateRequest.trace, passed on: the decode node's spans hang there


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest(Message):
    """Router → node: run this prompt."""

    TAG: ClassVar[str] = "generate"
    request_id: str  # unique across the cluster
    token_ids: tuple[int, ...]  # the prompt
    sampling_params: SamplingParams  # n == 1; stop strings stay with the router
    reply_addr: str  # the router's ZeroMQ PULL address for TokenChunk / RequestFailed
    decode_addr: str | None  # prefill node: KV address of the decode node; None: generate locally
    # Wall clock (time.time()) by which the request must be over, set once by the router and carried
    # on to the decode node: its whole life stays within the router's TTL (hosts need NTP-close clocks).
    deadline: float
    arrival_time: float = 0.0  # router's wall clock at arrival, for queue-time metrics
    # A migrated request: output tokens already streamed by a node that died. The (decode) node
    # computes prompt + these and continues from there: positions, penalties, seeded draws and
    # max_tokens go on as if uninterrupted; it sends only the tokens after them.
    output_token_ids: tuple[int, ...] = ()
    # Where the node's spans of this request hang (its attempt span on the router, or the client's
    # context); None: nobody traces it, and the node makes no span for it
    trace: TraceContext | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TokenChunk(Message):
    """Node → router: new tokens of a request (the first from the prefill node)."""

    TAG: ClassVar[str] = "tokens"
    request_id: str
    node_id: str  # who produced them
    token_ids: tuple[int, ...]  # new tokens, in order
    logprobs: tuple[TokenLogprobs, ...]  # one per token when asked for, else empty
    finish_reason: FinishReason | None  # set on the last chunk
    num_prompt_tokens: int  # usage: prompt length
    num_cached_tokens: int  # usage: prompt tokens that came from a prefix cache
    is_first: bool = False  # the prefill node's first token; decode chunks follow
    timings: StageTimings | None = None  # on the last chunk: where the request's time went
    # SamplingParams.prompt_logprobs, on the first chunk of the node that ran the prompt: one per
    # prompt token after the first
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    # where this chunk's tokens start in the request's output (a resumed request's count from
    # the tokens it resumed after): the router orders the prefill and decode nodes' chunks by it
    position: int = 0
    # A beam-search request answers in one chunk, when the search is over: its tokens are the best
    # beam's, these the others', best first (SamplingParams.n beams in all)
    beams: tuple[BeamOutput, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RequestFailed(Message):
    """Node → router: the request cannot go on on this node."""

    TAG: ClassVar[str] = "failed"
    request_id: str
    node_id: str
    code: FailureCode
    message: str
    retryable: bool  # no token was emitted by this node, the router may try elsewhere


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AbortRequest(Message):
    """Router → node: stop this request and free its blocks."""

    TAG: ClassVar[str] = "abort_request"
    request_id: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StatusQuery(Message):
    """Router → node: reply with a NodeStatus, on the same socket or through ``reply_addr``."""

    TAG: ClassVar[str] = "status_query"
    nonce: int  # echoed back
    # Answer through this PUSH address, the one tokens take: an answer proves the router's reply
    # path works from this node (a router advertising an address the node cannot reach gets none).
    reply_addr: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeStatus(Message):
    """Node → router: the record the node publishes to Redis (protocol.registry.NodeInfo); empty
    before the node has one."""

    TAG: ClassVar[str] = "status"
    nonce: int
    info: NodeInfo | None  # None while the node has no record yet


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SetRole(Message):
    """Router → node: serve as ``role`` (prefill, decode or colocated) from now on, keeping the
    weights: the node drains what its present role holds, then re-registers. Answered with a
    RoleChange through ``reply_addr`` when taken (or refused), and another when done."""

    TAG: ClassVar[str] = "set_role"
    nonce: int  # echoed back
    role: Role
    reply_addr: str


class RolePhase(enum.StrEnum):
    DRAINING = "draining"  # taken: the old role's work finishes first
    DONE = "done"  # serving as the new role, registered so
    REFUSED = "refused"  # not taken (RoleChange.error says why); the node serves on as it did


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoleChange(Message):
    """Node → router: where a SetRole stands."""

    TAG: ClassVar[str] = "role_change"
    nonce: int
    node_id: str
    role: Role  # the role asked for
    phase: RolePhase
    error: str | None = None  # why, when refused


MESSAGE_TYPES: tuple[type[Message], ...] = (
    GenerateRequest,
    TokenChunk,
    RequestFailed,
    AbortRequest,
    StatusQuery,
    NodeStatus,
    SetRole,
    RoleChange,
)
_TAG_TO_TYPE = {cls.TAG: cls for cls in MESSAGE_TYPES}


def encode(msg: Message) -> bytes:
    return codec.encode(msg)


def decode(header: bytes | memoryview) -> Message:
    """Strictly parse a router/node message; raises ProtocolError on anything else."""
    return codec.decode_with(header, _TAG_TO_TYPE)


def reply_address_of(header: bytes) -> tuple[str, str] | None:
    """(request_id, reply_addr) of a GenerateRequest that failed to decode, when its header still
    names them: the node can then end that request on the router at once instead of leaving it to
    its deadline. None for anything else."""
    try:
        version, tag, fields = msgpack.unpackb(header, raw=False)
        rid, addr = fields["request_id"], fields["reply_addr"]
    except Exception:  # noqa: BLE001  (best effort over bytes that already failed to decode)
        return None
    if tag != GenerateRequest.TAG or not (isinstance(rid, str) and isinstance(addr, str) and rid and addr):
        return None
    return rid, addr


def decode_frames(header: memoryview, frames, max_frame_bytes: int) -> Message:
    """``decode`` in the shape protocol.channel takes; these messages carry no data frames."""
    return codec.decode_with(header, _TAG_TO_TYPE, frames, max_frame_bytes)
