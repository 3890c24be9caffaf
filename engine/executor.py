"""The executor: one scheduler's steps run on the node's tensor-parallel ranks (after vLLM v1's
Executor; written for pdserve).

    rank 0 (this process): the ModelRunner of shard 0; plans each step, samples
    ranks 1..N-1 (engine/worker.py, child processes this executor starts and owns): a ModelRunner
        each, on their shard; they never schedule, they follow rank 0's plans

Each step's plan (model_runner.StepPlan: plain arrays, no Sequence) goes to every worker once,
as one msgpack frame on its socket pair, before rank 0 runs it; the ranks then meet in the
layers' collectives (torch.distributed: gloo on the CPU, NCCL on CUDA, from the platform), and
only rank 0 keeps the logits. Calls that run the model outside a step (the start-up profile, the
prefill timing), the KV pool's allocation and LoRA slot changes (rank 0 picks the slot, each
worker reads the adapter's folder and fills its shard of it) go to every rank the same way. At tp=1 there are no
workers and no group: the same executor, rank 0 alone.

A worker that exits or reports an error fails the node: ``failure`` says which rank and how,
and every later call raises WorkerLost (a group is not trusted after a lost rank or a collective
timeout; nothing tries to recover). A hung worker holds rank 0 in a collective until the group's
timeout, which then raises. Workers exit when rank 0 says so or its socket closes (rank 0 gone).
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import os
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import msgpack
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.lora import LoRAAdapter, LoRAModel, SlotAssignment
from pdserve.engine.model_runner import KV_TORCH_DTYPES, KVCacheFactory, ModelRunner
from pdserve.engine.parallel import ParallelState, close_parallel, init_parallel
from pdserve.engine.platform import Platform
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kv_transfer.tensors import HeadSplitCache
from pdserve.protocol.kv_layout import KVCacheSpec, kv_heads_of

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # every worker joined the group and loaded its shard
COLLECTIVE_TIMEOUT_S = 120.0  # any one collective; past it the group is broken
_HEADER = struct.Struct("!I")


class WorkerLost(RuntimeError):
    """A tensor-parallel rank of this node exited, failed or timed out: the node cannot step."""


def send_frame(sock: socket.socket, message: dict) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> dict | None:
    """The next message, or None when the peer closed its end."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = _recv_exactly(sock, _HEADER.unpack(header)[0])
    if body is None:
        return None
    return msgpack.unpackb(body, raw=False)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


@dataclasses.dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    sock: socket.socket


class Executor:
    """Runs steps on ``tp_size`` ranks: rank 0's ModelRunner in this process, the others in
    worker processes. ``runner`` is rank 0's (its model, KV pool and logits)."""

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
        self.workers: list[_Worker] = []
        self.failure: str | None = None  # why the ranks cannot step any more (the node polls it)
        self._closing = False
        self.pools: list[SharedPool] = []  # at several ranks: each rank's KV pool, mapped here
        self.transfer_caches: list = []
        parallel = ParallelState()
        if tp_size == 1 and group_of_one:
            parallel = init_parallel(
                1, 0, f"tcp://127.0.0.1:{_free_port()}", platform.dist_backend, collective_timeout_s, True
            )
        if tp_size > 1:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            init = dict(
                model=model_config.path,
                config=dataclasses.asdict(config),
                tp_size=tp_size,
                init_method=init_method,
                backend=platform.dist_backend,
                timeout_s=collective_timeout_s,
                threads=threads_per_rank,
            )
            self.workers = [self._start_worker(rank, init) for rank in range(1, tp_size)]
            try:
                parallel = init_parallel(tp_size, 0, init_method, platform.dist_backend, collective_timeout_s)
            except Exception as e:
                self.close()
                raise WorkerLost(f"the tensor-parallel group did not form: {e}") from None
        self.parallel = parallel
        try:
            self.runner = ModelRunner(model_config, config, platform=platform, parallel=parallel)
        except Exception:
            self.close()
            raise
        self._await_ready(start_timeout_s)
        if self.workers:
            threading.Thread(target=self._watch, name="tp-monitor", daemon=True).start()

    # ------------------------------------------------------------------ start and stop
    def _start_worker(self, rank: int, init: dict) -> _Worker:
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.engine.worker", "--fd", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        send_frame(ours, {**init, "rank": rank})
        return _Worker(rank, proc, ours)

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            w.sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                reply = recv_frame(w.sock)
            except TimeoutError:
                reply = {"error": f"not ready within {timeout_s:g} s"}
            w.sock.settimeout(None)
            if reply is None or "error" in reply:
                why = "exited" if reply is None else reply["error"]
                self.close()
                raise WorkerLost(f"tensor-parallel rank {w.rank} failed to start: {why}")

    def _watch(self) -> None:
        """Rank 0's monitor: a worker's error report, or its socket closing (it exited), fails
        the node."""
        sel = selectors.DefaultSelector()
        for w in self.workers:
            sel.register(w.sock, selectors.EVENT_READ, w)
        while not self._closing:
            for key, _ in sel.select(timeout=1.0):
                w = key.data
                try:
                    message = recv_frame(w.sock)
                except OSError:
                    message = None
                if self._closing:
                    return
                if message is None:
                    try:
                        code: object = w.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = "its socket closed, the process still running"
                    self._fail(f"tensor-parallel rank {w.rank} exited ({code})")
                else:
                    self._fail(f"tensor-parallel rank {w.rank}: {message.get('error')}")
                return

    def _fail(self, why: str) -> None:
        if self.failure is not None:
            return
        self.failure = why
        log.error("%s: this node's ranks cannot step any more", why)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (Shutdown, then SIGKILL past ``timeout_s``) and leave the group."""
        self._closing = True
        for w in self.workers:
            try:
                send_frame(w.sock, {"op": "shutdown"})
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.sock.close()
        self.workers = []
        if hasattr(self, "parallel"):
            close_parallel(self.parallel)

    # ------------------------------------------------------------------ every rank
    def _all(self, message: dict) -> None:
        """Send ``message`` to every worker (then rank 0 does the same)."""
        if self.failure is not None:
            raise WorkerLost(self.failure)
        for w in self.workers:
            self._send(w, message)

    def _send(self, w: _Worker, message: dict, fd: int | None = None) -> None:
        """``message`` to one worker, with ``fd`` after it (SCM_RIGHTS) where given."""
        try:
            send_frame(w.sock, message)
            if fd is not None:
                socket.send_fds(w.sock, [b"f"], [fd])
        except OSError as e:
            self._fail(f"tensor-parallel rank {w.rank} unreachable ({e})")
            raise WorkerLost(self.failure) from None

    def _guard(self, run: Callable[[], object]):
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

        With several ranks, each pool is a memfd that rank 0 makes and maps, and hands its worker
        (SCM_RIGHTS on the socket): rank 0's transfer reads and writes every rank's heads in
        place (``kv_caches``) without a collective beside the steps'. ``factory`` (a node's
        one-copy shared cache) is for a single rank."""
        if not self.workers:
            self.runner.allocate_kv(spec, factory)
            return
        assert factory is None, "a tensor-parallel node's pools are its ranks' shared memory"
        h = self.runner.model_config.num_kv_heads
        heads = [kv_heads_of(h, self.tp_size, r) for r in range(self.tp_size)]
        specs = [dataclasses.replace(spec, num_kv_heads=len(mine)) for mine in heads]  # ranks may differ
        assert specs[0] == spec, (spec, specs[0])
        self.pools = [SharedPool(s) for s in specs]
        for w, pool, own in zip(self.workers, self.pools[1:], specs[1:], strict=True):
            self._send(w, {"op": "allocate_kv", "spec": dataclasses.asdict(own)}, pool.fd)
        self.runner.allocate_kv(spec, lambda s: self.pools[0].layer_caches())
        self.transfer_caches = [
            tuple(
                HeadSplitCache([p.layer_caches()[layer][kind] for p in self.pools], heads) for kind in (0, 1)
            )
            for layer in range(spec.num_layers)
        ]

    def profile(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        self._all({"op": "profile", "args": [num_tokens, num_seqs, max_model_len]})
        self._guard(lambda: self.runner.profile(num_tokens, num_seqs, max_model_len))

    def time_prefill(self, num_tokens: int) -> float:
        self._all({"op": "time_prefill", "num_tokens": num_tokens})
        return self._guard(lambda: self.runner.time_prefill(num_tokens))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput):
        """One step on every rank: ModelRunner.execute's results, from rank 0."""
        plan, sampled, scored = self.runner.plan(sched)
        if self.workers:
            self._all({"op": "step", "plan": plan.to_wire()})
        return self._guard(lambda: self.runner.run(plan, sampled, scored))

    def load_adapter(self, adapter: LoRAAdapter) -> SlotAssignment:
        """Put ``adapter`` (read and checked by rank 0) in a slot on every rank: rank 0's slot
        table picks the slot (LoRAModel.load); each worker reads the adapter's folder itself and
        copies its own shard into that slot. Weights never cross the socket."""
        lora = self.runner.lora
        assert lora is not None, "LoRA slots exist with enable_lora only"
        assignment = lora.load(adapter)
        if assignment.is_new and self.workers:
            self._all(
                {"op": "lora_fill", "slot": assignment.slot, "name": adapter.name, "path": adapter.path}
            )
        return assignment

    def unload_adapter(self, name: str) -> None:
        """Free ``name``'s slot on every rank (LoRAModel.unload: ValueError while it is pinned)."""
        lora = self.runner.lora
        assert lora is not None, "LoRA slots exist with enable_lora only"
        slot = lora.slot_of(name)
        lora.unload(name)
        if slot is not None and self.workers:
            self._all({"op": "lora_clear", "slot": slot})

    def prompt_logits(self, hidden: torch.Tensor, max_rows: int = 256):
        """Rank 0's ModelRunner.prompt_logits; the workers make the same calls in their step."""
        chunks = self.runner.prompt_logits(hidden, max_rows)
        while (chunk := self._guard(lambda: next(chunks, None))) is not None:
            yield chunk

    # ------------------------------------------------------------------ rank 0's
    @property
    def kv_caches(self) -> list:
        """Per layer (K, V) with every KV head of the model: rank 0's own pool, or at several
        ranks their pools seen as one (kv_transfer.tensors.HeadSplitCache): what a node's KV
        transfer reads and writes."""
        return self.transfer_caches if self.workers else self.runner.kv_caches

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


class SharedPool:
    """One rank's KV pool [L, 2, num_blocks, block_size, heads, row] in a memfd: made by rank 0
    (``fd`` None) or mapped by the worker it was handed to. Its pages are committed as blocks are
    first written, like a private pool's."""

    def __init__(self, spec: KVCacheSpec, fd: int | None = None) -> None:
        size = spec.num_blocks * spec.bytes_per_block
        if fd is None:
            fd = os.memfd_create("pdserve-kv-rank", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
        self.fd, self._map = fd, mmap.mmap(fd, size)
        shape = (spec.num_layers, 2, spec.num_blocks, *spec.block_shape)
        self.tensor = torch.frombuffer(self._map, dtype=KV_TORCH_DTYPES[spec.dtype]).view(shape)

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.tensor[layer, 0], self.tensor[layer, 1]) for layer in range(self.tensor.shape[0])]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
