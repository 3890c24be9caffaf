"""The executor: one scheduler's steps run on the node's tensor-parallel ranks (after vLLM v1's
Executor; written for pdserve).

    rank 0 (this process): the ModelRunner of shard 0; plans each step, samples
    ranks 1..N-1 (engine/executor/worker.py, child processes this executor starts and owns): a ModelRunner
        each, on their shard; they never schedule, they follow rank 0's plans

Every call to the ranks is a typed message (engine/executor/rank_messages.py) that goes to each worker on
its socket pair. For a call that makes collectives rank 0 then runs the workers' own handler
itself (worker.HANDLERS, ``_on_every_rank``): a step's plan (model_runner.StepPlan: plain arrays,
no Sequence) becomes a model_runner.StepRun on every rank, so the ranks meet in the same
collectives (torch.distributed: gloo on the CPU, NCCL on CUDA, from the platform) in the same
order. Only rank 0 plans the step from its sequences before the call, and keeps the logits after
it. Calls that run the model outside a step (the start-up profile, the prefill timing) go the
same way. The KV pool's allocation and LoRA slot changes are messages too (rank 0 picks the
slot, each worker reads the adapter's folder and fills its shard of it). At tp=1 there are no
workers and no group: the same executor, rank 0 alone.

A worker that exits or reports an error fails the node: ``failure`` says which rank and how,
and every later call raises WorkerLost (a group is not trusted after a lost rank or a collective
timeout; nothing tries to recover). Rank 0's monitor then aborts the group, so a collective that
waits on the lost rank fails at once (NCCL would wait in it until its watchdog ends the process).
A hung worker holds rank 0 in a collective until the group's timeout, which then raises.

Starting fails fast too: every rank's CUDA device must exist before any worker starts, and a
worker that fails before the group forms is named by the error it sent on its socket, not by
the rendezvous' timeout. Workers exit when rank 0 says so or its socket closes (rank 0 gone).
"""

from __future__ import annotations

import dataclasses
import logging
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.scheduler import SchedulerOutput
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.executor.model_runner import KVCacheFactory, ModelRunner
from pdserve.engine.executor.parallel import ParallelState, abort_parallel, close_parallel, init_parallel
from pdserve.engine.executor.platform import Platform, check_rank_devices
from pdserve.engine.executor.rank_messages import (
    AllocateKV,
    ClearLoRASlot,
    Failed,
    FillLoRASlot,
    Joining,
    Profile,
    RankChannel,
    RankMessage,
    RankMessageError,
    Ready,
    Shutdown,
    StepCall,
    TimePrefill,
    WorkerStart,
)
from pdserve.engine.executor.rank_pools import PoolsNotShared, RankPool, SharedPool
from pdserve.engine.executor.worker import HANDLERS, Worker
from pdserve.engine.lora import LoRAAdapter, LoRAModel, SlotAssignment
from pdserve.protocol.kv_layout import KVCacheSpec, kv_heads_of

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # every worker joined the group and loaded its shard
COLLECTIVE_TIMEOUT_S = 120.0  # any one collective; past it the group is broken
T = TypeVar("T")
C = TypeVar("C", bound=RankMessage)
# One step's results on rank 0: logits [R, vocab] of the rows due a token, their sequences, and
# each sequence due prompt logprobs with its hidden rows [rows, hidden] (for ``prompt_logits``).
StepResult = tuple[torch.Tensor, list[Sequence], list[tuple[Sequence, torch.Tensor]]]


class WorkerLost(RuntimeError):
    """A tensor-parallel rank of this node exited, failed or timed out: the node cannot step."""


@dataclasses.dataclass
class _WorkerProcess:
    rank: int
    proc: subprocess.Popen
    channel: RankChannel


class Executor:
    """Runs steps on ``tp_size`` ranks: rank 0's ModelRunner in this process, the others in
    worker processes. ``runner`` is rank 0's (its model, KV pool and logits); ``rank0`` its
    handlers, the workers' own."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        platform: Platform,
        tp_size: int = 1,
        threads_per_rank: int | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
        group_of_one: bool = False,
    ) -> None:
        """``group_of_one``: at one rank, join a torch.distributed group of one anyway, so that the
        layers' collectives run on the platform's backend (bench/gpu_probe.py: NCCL on one GPU)."""
        self.tp_size, self.collective_timeout_s = tp_size, collective_timeout_s
        self.workers: list[_WorkerProcess] = []
        self.failure: str | None = None  # why the ranks cannot step any more (the node polls it)
        self._closing = False
        # at several ranks with pools in host memory: each rank's KV pool, mapped here; else empty
        self.pools: list[SharedPool] = []
        parallel = ParallelState()
        if tp_size == 1 and group_of_one:
            parallel = init_parallel(
                1,
                0,
                f"tcp://127.0.0.1:{_free_port()}",
                platform.dist_backend,
                collective_timeout_s,
                True,
                platform.device,
            )
        if tp_size > 1:
            check_rank_devices(config.device, tp_size)  # a missing device fails here, not in a join
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            self.workers = [
                self._start_worker(
                    WorkerStart(
                        rank=rank,
                        tp_size=tp_size,
                        model=model_config.path,
                        config=config,
                        init_method=init_method,
                        backend=platform.dist_backend,
                        timeout_s=collective_timeout_s,
                        threads=threads_per_rank,
                    )
                )
                for rank in range(1, tp_size)
            ]
            self._await_joining(start_timeout_s)
            try:
                parallel = init_parallel(
                    tp_size,
                    0,
                    init_method,
                    platform.dist_backend,
                    collective_timeout_s,
                    device=platform.device,
                )
            except Exception as e:
                self.close()
                raise WorkerLost(f"the tensor-parallel group did not form: {e}") from None
        self.parallel = parallel
        try:
            self.runner = ModelRunner(model_config, config, platform=platform, parallel=parallel)
        except Exception:
            self.close()
            raise
        self.rank0 = Worker(self.runner)
        self._await_ready(start_timeout_s)
        if self.workers:
            threading.Thread(target=self._watch, name="tp-monitor", daemon=True).start()

    # ------------------------------------------------------------------ start and stop
    def _start_worker(self, start: WorkerStart) -> _WorkerProcess:
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.engine.executor.worker", "--fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        channel = RankChannel(ours)
        channel.send(start)
        return _WorkerProcess(start.rank, proc, channel)

    def _await_joining(self, timeout_s: float) -> None:
        """Every worker's Joining (its device is set up), before rank 0 joins the group: a worker
        that failed or exited first is named now, by the error it sent."""
        self._await_each(Joining, timeout_s)

    @staticmethod
    def _start_reply(w: _WorkerProcess, timeout_s: float) -> RankMessage:
        """Worker ``w``'s next start reply (Joining, Ready, or Failed with why; a closed socket or
        silence: Failed)."""
        try:
            reply = w.channel.recv(timeout_s)
        except TimeoutError:
            return Failed(f"no reply within {timeout_s:g} s")
        except (OSError, RankMessageError) as e:
            return Failed(str(e))
        return Failed(Executor._exited(w) or "its socket closed") if reply is None else reply

    def _await_ready(self, timeout_s: float) -> None:
        self._await_each(Ready, timeout_s)

    def _await_each(self, expected: type[RankMessage], timeout_s: float) -> None:
        """Every worker's ``expected`` start reply within ``timeout_s``; WorkerLost naming the
        first worker that sent another (its Failed says why), exited or stayed silent."""
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            reply = self._start_reply(w, max(0.1, deadline - time.monotonic()))
            if not isinstance(reply, expected):
                self.close()
                raise WorkerLost(f"tensor-parallel rank {w.rank} failed to start: {_why(reply)}")

    def _watch(self) -> None:
        """Rank 0's monitor: a worker's Failed, or its socket closing (it exited), fails the node
        and aborts the group."""
        sel = selectors.DefaultSelector()
        for w in self.workers:
            sel.register(w.channel, selectors.EVENT_READ, w)
        while not self._closing:
            for key, _ in sel.select(timeout=1.0):
                w = key.data
                try:
                    message = w.channel.recv()
                except (OSError, RankMessageError) as e:
                    message = None if isinstance(e, OSError) else Failed(str(e))
                if self._closing:
                    return
                if message is None:
                    self._lose_rank(
                        self._exited(w)
                        or f"tensor-parallel rank {w.rank} exited (its socket closed, the process still running)"
                    )
                else:
                    self._lose_rank(f"tensor-parallel rank {w.rank}: {_why(message)}")
                return

    def _lose_rank(self, why: str) -> None:
        """The monitor's verdict: the node fails, and the group is aborted, so that rank 0, where
        it waits on the lost rank in a collective (on NCCL, in a device sync behind it), raises
        now and the node publishes its last record before it exits."""
        self._fail(why)
        abort_parallel(self.parallel)

    def _fail(self, why: str) -> None:
        if self.failure is not None:
            return
        self.failure = why
        log.error("%s: this node's ranks cannot step any more", why)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (Shutdown, then SIGKILL past ``timeout_s``) and leave the group."""
        if self.workers and self.failure is None and hasattr(self, "rank0"):
            try:  # the last step's LM-head calls: the workers wait in them for rank 0
                self._guard(self.rank0.settle)
            except WorkerLost:
                pass
        self._closing = True
        for w in self.workers:
            try:
                w.channel.send(Shutdown())
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.channel.close()
        self.workers = []
        if hasattr(self, "parallel"):
            close_parallel(self.parallel)

    # ------------------------------------------------------------------ every rank
    def _to_workers(self, call: RankMessage) -> None:
        """Send ``call`` to every worker, once rank 0 has settled its last step; rank 0 then runs
        the same handler itself."""
        self._check_alive()
        self._guard(self.rank0.settle)
        for w in self.workers:
            self._send(w, call)

    def _on_every_rank(self, call: C, handler: Callable[[Worker, C], T]) -> T:
        """``call`` on every rank: each worker runs its handler (worker.HANDLERS), then rank 0 runs
        that same handler itself, under the collectives' guard."""
        assert HANDLERS[type(call)] is handler, f"{type(call).__name__}: not the workers' handler"
        self._to_workers(call)
        return self._guard(lambda: handler(self.rank0, call))

    def _send(self, w: _WorkerProcess, call: RankMessage, fd: int | None = None) -> None:
        """``call`` to worker ``w``, with ``fd`` after it where given."""
        try:
            w.channel.send(call)
            if fd is not None:
                w.channel.send_fd(fd)
        except OSError as e:  # its socket closed: it exited, which the monitor may not have seen yet
            self._fail(self._exited(w) or f"tensor-parallel rank {w.rank} unreachable ({e})")
            raise WorkerLost(self.failure) from None

    @staticmethod
    def _exited(w: _WorkerProcess) -> str | None:
        """How worker ``w`` ended, once its socket closed; None if it still runs 5 s later."""
        try:
            return f"tensor-parallel rank {w.rank} exited ({w.proc.wait(timeout=5)})"
        except subprocess.TimeoutExpired:
            return None

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise WorkerLost(self.failure)

    def _guard(self, run: Callable[[], T]) -> T:
        start = time.monotonic()
        try:
            return run()
        except RuntimeError as e:  # a collective failed: a rank gone, or one hung past the timeout
            if not self.workers:
                raise
            time.sleep(0.5)  # the monitor names the rank where one exited
            waited = time.monotonic() - start
            self._fail(
                self.failure
                or f"a collective between the ranks failed after {waited:.0f} s (timeout "
                f"{self.collective_timeout_s:g} s): {str(e)[:200]}"
            )
            raise WorkerLost(self.failure) from None

    def allocate_kv(self, spec: KVCacheSpec, factory: KVCacheFactory | None = None) -> None:
        """Each rank's pool of ``spec`` (its own heads; the same block ids on every rank).

        With several ranks and pools in host memory, each pool is a memfd that rank 0 makes and
        maps, and hands its worker beside the call (engine/executor/rank_pools.py): ``rank_pools``
        offers every rank's heads in place, for a node's KV transfer. Pools in device memory are
        each rank's own allocation, and no host copy stands in for them. ``factory`` (a node's
        one-copy shared cache) is for one rank."""
        if not self.workers:
            self.rank0.allocate_kv(AllocateKV(spec), factory)
            return
        assert factory is None, "a tensor-parallel node's pools are its ranks' own"
        specs = [dataclasses.replace(spec, num_kv_heads=len(heads)) for heads in self._heads()]
        assert specs[0] == spec, (spec, specs[0])  # rank 0 holds the most heads: the engine sizes by it
        self._check_alive()
        if self.runner.platform.separate_host:
            for w, own in zip(self.workers, specs[1:], strict=True):
                self._send(w, AllocateKV(own, in_memfd=False))
            self.rank0.allocate_kv(AllocateKV(spec, in_memfd=False), None)
            return
        self.pools = [SharedPool(s) for s in specs]
        for w, own, pool in zip(self.workers, specs[1:], self.pools[1:], strict=True):
            self._send(w, AllocateKV(own), pool.fd)  # each rank's spec is its own
        caches = self.pools[0].layer_caches()
        self.rank0.allocate_kv(AllocateKV(spec), lambda _spec: caches)

    def profile(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        self._on_every_rank(Profile(num_tokens, num_seqs, max_model_len), Worker.profile)

    def time_prefill(self, num_tokens: int) -> float:
        return self._on_every_rank(TimePrefill(num_tokens), Worker.time_prefill)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """One step on every rank (model_runner.StepRun), with rank 0's work around it: the plan
        from its sequences before; after, the logits of the rows due a token with their sequences,
        and each sequence due prompt logprobs with its hidden rows, which ``prompt_logits`` turns
        into logits a slice at a time."""
        plan, sampled, scored = self.runner.plan(sched)
        run = self._on_every_rank(StepCall(plan), Worker.step)
        return run.logits, sampled, list(zip(scored, run.prompt_hidden, strict=True))

    def prompt_logits(self, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, logits [rows, vocab]) of ``hidden``, a prompt range of the last step (from
        ``execute``), a slice at a time: that step's LM-head calls, made on every rank."""
        run = self.rank0.current
        assert run is not None, "prompt rows are read after their step, before the next call"
        chunks = run.prompt_logits(hidden)
        while (chunk := self._guard(lambda: next(chunks, None))) is not None:
            yield chunk

    def load_adapter(self, adapter: LoRAAdapter) -> SlotAssignment:
        """Put ``adapter`` (read and checked by rank 0) in a slot on every rank: rank 0's slot
        table picks the slot and fills its own (LoRAModel.load); each worker reads the adapter's
        folder itself and copies its own shard into that slot. Weights never cross the socket."""
        lora = self.runner.lora
        assert lora is not None, "LoRA slots exist with enable_lora only"
        self._guard(self.rank0.settle)  # the last step's prompt rows, before a slot changes
        assignment = lora.load(adapter)
        if assignment.is_new and self.workers:
            self._to_workers(FillLoRASlot(assignment.slot, adapter.name, str(adapter.path)))
        return assignment

    def unload_adapter(self, name: str) -> None:
        """Free ``name``'s slot on every rank (LoRAModel.unload: ValueError while it is pinned)."""
        lora = self.runner.lora
        assert lora is not None, "LoRA slots exist with enable_lora only"
        self._guard(self.rank0.settle)
        slot = lora.slot_of(name)
        lora.unload(name)
        if slot is not None and self.workers:
            self._to_workers(ClearLoRASlot(slot))

    # ------------------------------------------------------------------ rank 0's
    @property
    def rank_pools(self) -> list[RankPool]:
        """Every rank's KV pool as this process sees it, in rank order, with the model's KV heads
        each holds: rank 0's own at one rank, each rank's shared memory at several. What a node
        wraps for its KV transfer (the engine itself reads rank 0's only). PoolsNotShared at
        several ranks whose pools are in device memory: rank 0 sees its own only."""
        assert self.runner.kv_caches, "allocate the KV pool first"
        if self.tp_size == 1:
            return [RankPool(0, range(self.runner.model_config.num_kv_heads), self.runner.kv_caches)]
        if not self.pools:
            raise PoolsNotShared(
                f"the KV pools of this node's {self.tp_size} tensor-parallel ranks are in their "
                f"devices' memory ({self.runner.platform.kind}), which rank 0 does not map"
            )
        return [
            RankPool(rank, heads, pool.layer_caches())
            for rank, (heads, pool) in enumerate(zip(self._heads(), self.pools, strict=True))
        ]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copies of these blocks with every KV head of the model, from every rank's pool:
        [len(block_ids), num_layers, 2 (K, V), block_size, kv_heads, row], on the host."""
        pools = self.rank_pools
        index = torch.tensor(block_ids, dtype=torch.long, device=pools[0].layer_caches[0][0].device)
        k0 = pools[0].layer_caches[0][0]  # [num_blocks, block_size, heads of rank 0, row]
        shape = (len(block_ids), len(pools[0].layer_caches), 2, k0.shape[1], self._num_kv_heads, k0.shape[3])
        out = torch.empty(shape, dtype=k0.dtype)
        for pool in pools:  # a head several ranks hold (more ranks than heads) is the same on each
            heads = slice(pool.kv_heads.start, pool.kv_heads.stop)
            for layer, (k, v) in enumerate(pool.layer_caches):
                out[:, layer, 0, :, heads] = k.index_select(0, index).cpu()
                out[:, layer, 1, :, heads] = v.index_select(0, index).cpu()
        return out

    def write_blocks(self, block_ids: list[int], payload: torch.Tensor) -> None:
        """Fill these blocks of every rank's pool with their heads of ``payload``
        [len(block_ids), num_layers, 2, block_size, kv_heads, row] (``read_blocks``' layout)."""
        pools = self.rank_pools
        k0 = pools[0].layer_caches[0][0]
        assert payload.shape[0] == len(block_ids) and payload.shape[4] == self._num_kv_heads, payload.shape
        assert payload.dtype == k0.dtype, (payload.dtype, k0.dtype)
        index = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
        for pool in pools:
            heads = slice(pool.kv_heads.start, pool.kv_heads.stop)
            for layer, (k, v) in enumerate(pool.layer_caches):
                k.index_copy_(0, index, payload[:, layer, 0, :, heads].to(k.device))
                v.index_copy_(0, index, payload[:, layer, 1, :, heads].to(v.device))

    @property
    def _num_kv_heads(self) -> int:
        return self.runner.model_config.num_kv_heads

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rank 0's own KV pool, per layer (K, V) [num_blocks, block_size, kv_heads, row]: every
        head of the model at one rank. At several, a node's transfer wraps ``rank_pools``."""
        assert self.tp_size == 1, "rank 0 holds only its own KV heads: see rank_pools"
        return self.runner.kv_caches

    def _heads(self) -> list[range]:
        """The model's KV heads each rank holds, in rank order."""
        h = self.runner.model_config.num_kv_heads
        return [kv_heads_of(h, self.tp_size, rank) for rank in range(self.tp_size)]

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def lora_slots(self) -> LoRAModel:
        """The LoRA slot table that decides which adapter a slot holds (rank 0's; every rank
        follows its choices through ``load_adapter`` and ``unload_adapter``)."""
        lora = self.runner.lora
        assert lora is not None, "LoRA slots exist with enable_lora only"
        return lora

    def set_on_layer(self, callback: Callable[[], None] | None) -> None:
        """The liveness stamp before each decoder layer: rank 0's alone."""
        self.runner.on_layer = callback

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        assert not self.workers, "CUDA graphs run at one rank only (cuda_graphs.why_eager)"
        self.runner.use_decode_graphs(max_num_seqs, max_model_len)


def _why(message: RankMessage) -> str:
    return message.error if isinstance(message, Failed) else f"unexpected {type(message).__name__}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
