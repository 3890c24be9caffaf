"""What crosses between a node's rank 0 (engine/executor/executor.py) and its worker ranks
(engine/executor/worker.py), and the socket it crosses on.

Rank 0 schedules; the workers hold the other shards of the model and the KV heads, and run what
rank 0 tells them, in the order it tells them: every call that makes collectives (a step, the
profile, the prefill timing) must reach every rank, or the group deadlocks. So each call is one
typed message, and a worker looks up its handler by the message's type: nothing is dispatched
on strings, and a message a worker does not take is an error, not a silent skip.

    rank 0 -> worker   WorkerStart (first, once), then StepCall, AllocateKV (+ a memfd for a host pool),
                       Profile, TimePrefill, FillLoRASlot, ClearLoRASlot, Shutdown
    worker -> rank 0   Joining, then Ready (once each, after WorkerStart), Failed (then the
                       worker exits)

On the socket (one end of a socket pair, rank 0's executor holding the other) each message is a
4-byte length and a msgpack body ``[tag, {field: value}]``; never pickle. A file descriptor (a
rank's KV pool) rides beside a message as SCM_RIGHTS. Both ends are the same installed code (rank
0 starts its workers from its own interpreter), so the body carries no protocol version; a tag
or field one end does not know is still refused loudly (``RankMessageError``).
"""

from __future__ import annotations

import dataclasses
import socket
import struct
from typing import Any, ClassVar

import msgpack

from pdserve.engine.config import EngineConfig
from pdserve.engine.executor.model_runner import StepPlan
from pdserve.protocol.kv_layout import KVCacheSpec

_LENGTH = struct.Struct("!I")


class RankMessageError(ValueError):
    """A frame that is not a rank message this code knows (unknown tag, missing or extra field)."""


class RankMessage:
    """Base of every message between rank 0 and a worker. ``TAG`` names the type on the wire;
    ``fields``/``from_fields`` turn a message into plain msgpack values and back (plain ints,
    floats and strings as they are; a subclass overrides both where a field is richer)."""

    __slots__ = ()
    TAG: ClassVar[str]

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> RankMessage:
        return cls(**fields)


# ------------------------------------------------------------------ rank 0 -> worker
@dataclasses.dataclass(frozen=True, slots=True)
class WorkerStart(RankMessage):
    """The first message: who the worker is and how to join the node's group."""

    TAG: ClassVar[str] = "start"
    rank: int  # this worker's tensor-parallel rank, 1 .. tp_size - 1
    tp_size: int  # ranks in the node's group
    model: str  # the model folder every rank loads its shard from
    config: EngineConfig  # the node's engine settings (the same on every rank)
    init_method: str  # torch.distributed's rendezvous, e.g. tcp://127.0.0.1:PORT (rank 0 listens)
    backend: str  # gloo on the CPU, nccl on CUDA (Platform.dist_backend)
    timeout_s: float  # the group's join and collective timeout
    threads: int | None  # torch threads for this rank; None: torch's default

    def fields(self) -> dict[str, Any]:
        return {**RankMessage.fields(self), "config": dataclasses.asdict(self.config)}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> WorkerStart:
        return cls(**{**fields, "config": EngineConfig(**fields["config"])})


@dataclasses.dataclass(frozen=True, slots=True)
class StepCall(RankMessage):
    """Run one step: the forward pass and every LM-head call of ``plan`` (model_runner.StepRun)."""

    TAG: ClassVar[str] = "step"
    plan: StepPlan  # the step's whole input, the same on every rank; no Sequence in it

    def fields(self) -> dict[str, Any]:
        return {"plan": self.plan.to_wire()}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> StepCall:
        return cls(StepPlan.from_wire(fields["plan"]))


@dataclasses.dataclass(frozen=True, slots=True)
class AllocateKV(RankMessage):
    """This rank's KV pool: mapped from the memfd that follows the message where rank 0 made one
    (a pool in host memory: engine/executor/rank_pools.py), allocated by the rank itself in its
    device's memory otherwise."""

    TAG: ClassVar[str] = "allocate_kv"
    spec: KVCacheSpec  # this rank's pool: its own KV heads, the same block ids as every rank's
    in_memfd: bool = True  # a memfd follows (host memory rank 0 maps); False: a device pool of its own

    def fields(self) -> dict[str, Any]:
        return {"spec": dataclasses.asdict(self.spec), "in_memfd": self.in_memfd}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> AllocateKV:
        return cls(KVCacheSpec(**fields["spec"]), fields["in_memfd"])


@dataclasses.dataclass(frozen=True, slots=True)
class Profile(RankMessage):
    """Run the start-up profile's largest steps on a throwaway pool (ModelRunner.profile)."""

    TAG: ClassVar[str] = "profile"
    num_tokens: int  # the prefill step's token budget
    num_seqs: int  # the decode step's rows
    max_model_len: int  # the longest context: the decode's block-table width


@dataclasses.dataclass(frozen=True, slots=True)
class TimePrefill(RankMessage):
    """Time one prefill of ``num_tokens`` tokens on a throwaway pool (ModelRunner.time_prefill)."""

    TAG: ClassVar[str] = "time_prefill"
    num_tokens: int  # the prompt's length


@dataclasses.dataclass(frozen=True, slots=True)
class FillLoRASlot(RankMessage):
    """Slot ``slot`` := this rank's shard of the adapter in ``path``, which the worker reads
    itself (weights never cross the socket). Rank 0 picked the slot and filled its own."""

    TAG: ClassVar[str] = "fill_lora_slot"
    slot: int  # the adapter slot, the same on every rank
    name: str  # the adapter's name, for errors
    path: str  # its PEFT folder


@dataclasses.dataclass(frozen=True, slots=True)
class ClearLoRASlot(RankMessage):
    """Slot ``slot`` := zeros (its adapter was unloaded on rank 0)."""

    TAG: ClassVar[str] = "clear_lora_slot"
    slot: int  # the adapter slot, the same on every rank


@dataclasses.dataclass(frozen=True, slots=True)
class Shutdown(RankMessage):
    """Leave the group and exit 0."""

    TAG: ClassVar[str] = "shutdown"


# ------------------------------------------------------------------ worker -> rank 0
@dataclasses.dataclass(frozen=True, slots=True)
class Ready(RankMessage):
    """The worker joined the group and loaded its shard: it takes calls now."""

    TAG: ClassVar[str] = "ready"


@dataclasses.dataclass(frozen=True, slots=True)
class Joining(RankMessage):
    """The worker's device is set up and it joins the group now: rank 0 joins only once every
    worker has said so, so a worker that fails before (its device missing, its start-up broken)
    is named by its Failed, not by the rendezvous' timeout."""

    TAG: ClassVar[str] = "joining"


@dataclasses.dataclass(frozen=True, slots=True)
class Failed(RankMessage):
    """The worker failed and exits non-zero: the node cannot step any more."""

    TAG: ClassVar[str] = "failed"
    error: str  # the exception's type and message, shortened


MESSAGES: dict[str, type[RankMessage]] = {
    cls.TAG: cls
    for cls in (
        WorkerStart,
        StepCall,
        AllocateKV,
        Profile,
        TimePrefill,
        FillLoRASlot,
        ClearLoRASlot,
        Shutdown,
        Joining,
        Ready,
        Failed,
    )
}


def to_wire(message: RankMessage) -> bytes:
    """``message``'s msgpack body: [tag, fields]."""
    return msgpack.packb([message.TAG, message.fields()], use_bin_type=True)


def from_wire(body: bytes) -> RankMessage:
    """The message of a msgpack body; RankMessageError for one this code does not know."""
    try:
        tag, fields = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise RankMessageError(f"not a rank message: {e}") from None
    cls = MESSAGES.get(tag) if isinstance(tag, str) else None
    if cls is None or not isinstance(fields, dict):
        raise RankMessageError(f"unknown rank message tag {tag!r}")
    try:
        return cls.from_fields(fields)
    except (TypeError, KeyError, ValueError) as e:
        raise RankMessageError(f"{cls.__name__}: {e}") from None


class RankChannel:
    """One end of the socket pair between rank 0 and one worker: rank messages as length-prefixed
    frames, and file descriptors beside them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, message: RankMessage) -> None:
        body = to_wire(message)
        self.sock.sendall(_LENGTH.pack(len(body)) + body)

    def recv(self, timeout_s: float | None = None) -> RankMessage | None:
        """The next message, or None when the peer closed its end (it exited); TimeoutError past
        ``timeout_s`` (None: wait as long as it takes)."""
        if timeout_s is not None:
            self.sock.settimeout(timeout_s)
        try:
            header = self._recv_exactly(_LENGTH.size)
            body = None if header is None else self._recv_exactly(_LENGTH.unpack(header)[0])
        finally:
            if timeout_s is not None:
                self.sock.settimeout(None)
        return None if body is None else from_wire(body)

    def send_fd(self, fd: int) -> None:
        socket.send_fds(self.sock, [b"f"], [fd])

    def recv_fd(self) -> int:
        _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        if not fds:
            raise RankMessageError("a file descriptor was due and none came")
        return fds[0]

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def _recv_exactly(self, n: int) -> bytes | None:
        chunks, got = [], 0
        while got < n:
            chunk = self.sock.recv(min(n - got, 1 << 20))
            if not chunk:
                return None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
