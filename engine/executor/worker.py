"""One tensor-parallel rank's side of the executor's calls (``Worker``), and the worker process
that runs it for ranks 1..N-1: ``python -m pdserve.engine.executor.worker --fd N``, started and owned by a
node's executor (engine/executor/executor.py), which holds the other end of socket ``N``.

Rank 0 holds a Worker too, and runs the same handler (``HANDLERS``) for each call with
collectives that it sends its workers (a step is model_runner.StepRun on every rank): the
collectives cannot diverge between the ranks, since there is one code path for them. What only rank 0 does (planning a step from its
sequences, keeping the logits, scoring prompts) happens in the executor around those calls.

The worker process joins the node's group, builds its ModelRunner on its shard and says it is
Ready, then takes rank 0's calls (engine/executor/rank_messages.py) one at a time through a table from
message type to handler. It never schedules. It ignores SIGINT and SIGTERM (rank 0 drains the
node, then sends Shutdown) and exits when rank 0's socket closes. An error is reported to rank 0
as Failed, and the worker exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.model_runner import KVCacheFactory, ModelRunner, StepRun
from pdserve.engine.executor.parallel import close_parallel, init_parallel
from pdserve.engine.executor.platform import rank_device, resolve_platform
from pdserve.engine.executor.rank_messages import (
    AllocateKV,
    ClearLoRASlot,
    Failed,
    FillLoRASlot,
    Joining,
    Profile,
    RankChannel,
    RankMessage,
    Ready,
    Shutdown,
    StepCall,
    TimePrefill,
    WorkerStart,
)
from pdserve.engine.executor.rank_pools import SharedPool
from pdserve.engine.lora import LoRAModel

log = logging.getLogger("pdserve.engine.executor.worker")


class Worker:
    """One rank's handlers, rank 0's and every worker's alike. ``step`` leaves its StepRun
    current until ``settle``: a worker settles at once, rank 0 once its engine has read the
    prompt rows it wants (before its next call)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.current: StepRun | None = None  # the last step, until every LM-head call is made

    def step(self, call: StepCall) -> StepRun:
        assert self.current is None or self.current.finished, "the last step was not settled"
        self.current = StepRun(self.runner, call.plan)
        return self.current

    def settle(self) -> None:
        """Finish the current step's LM-head calls (the prompt slices nobody read)."""
        if self.current is not None:
            self.current.finish()
            self.current = None

    def allocate_kv(self, call: AllocateKV, factory: KVCacheFactory | None) -> None:
        self.runner.allocate_kv(call.spec, factory)

    def profile(self, call: Profile) -> None:
        self.runner.profile(call.num_tokens, call.num_seqs, call.max_model_len)

    def time_prefill(self, call: TimePrefill) -> float:
        return self.runner.time_prefill(call.num_tokens)

    def fill_lora_slot(self, call: FillLoRASlot) -> None:
        lora = self._lora(call)
        lora.fill(call.slot, lora.read(call.name, call.path))

    def clear_lora_slot(self, call: ClearLoRASlot) -> None:
        self._lora(call).clear(call.slot)

    def _lora(self, call: RankMessage) -> LoRAModel:
        if self.runner.lora is None:
            raise ValueError(f"{type(call).__name__} on a rank built without LoRA slots")
        return self.runner.lora


# Each call's handler: a worker process looks the calls it takes up here, and rank 0's executor
# runs the same entry itself for every call that makes collectives (a step, the profile, the
# prefill timing: Executor._on_every_rank). A LoRA slot rank 0 fills or clears through its slot
# table (LoRAModel.load / unload) before it tells the workers; AllocateKV is each side's own (a
# worker maps the memfd that follows it: ``process_handlers``).
HANDLERS: dict[type[RankMessage], Callable[[Worker, Any], object]] = {
    StepCall: Worker.step,
    Profile: Worker.profile,
    TimePrefill: Worker.time_prefill,
    FillLoRASlot: Worker.fill_lora_slot,
    ClearLoRASlot: Worker.clear_lora_slot,
}


def process_handlers(channel: RankChannel) -> dict[type[RankMessage], Callable[[Worker, Any], object]]:
    """A worker process's handler of each call it takes (Shutdown ends its loop; WorkerStart comes
    once, before)."""

    def allocate_kv(worker: Worker, call: AllocateKV) -> None:
        worker.allocate_kv(call, _shared_pool(call, channel.recv_fd()) if call.in_memfd else None)

    return {**HANDLERS, AllocateKV: allocate_kv}


def _shared_pool(call: AllocateKV, fd: int) -> KVCacheFactory:
    """The KV pool in the memfd rank 0 sent after ``call`` (rank_pools.SharedPool)."""
    caches = SharedPool(call.spec, fd).layer_caches()
    return lambda _spec: caches


def serve(channel: RankChannel) -> int:
    start = channel.recv()
    if start is None:
        return 1
    if not isinstance(start, WorkerStart):
        raise ValueError(f"the first message was {type(start).__name__}, not WorkerStart")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {start.rank} %(levelname)s %(message)s")
    if start.threads:
        torch.set_num_threads(start.threads)
    platform = resolve_platform(rank_device(start.config.device, start.rank))
    channel.send(Joining())  # rank 0 joins after every worker has got this far
    parallel = init_parallel(
        start.tp_size, start.rank, start.init_method, start.backend, start.timeout_s, device=platform.device
    )
    try:
        runner = ModelRunner(
            ModelConfig.from_path(start.model), start.config, platform=platform, parallel=parallel
        )
        worker, table = Worker(runner), process_handlers(channel)
        channel.send(Ready())
        while (call := channel.recv()) is not None and not isinstance(call, Shutdown):
            handler = table.get(type(call))
            if handler is None:
                raise ValueError(f"a worker takes no {type(call).__name__}")
            handler(worker, call)
            worker.settle()  # rank 0 meets every LM-head call of a step, read or not
    finally:
        close_parallel(parallel)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the socket rank 0 holds the other end of")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    channel = RankChannel(socket.socket(fileno=args.fd))
    try:
        return serve(channel)
    except Exception as e:  # noqa: BLE001 - any failure ends this rank, and rank 0 is told why
        traceback.print_exc()
        try:
            channel.send(Failed(f"{type(e).__name__}: {str(e)[:500]}"))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
