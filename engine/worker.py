"""A tensor-parallel worker rank: ``python -m pdserve.engine.worker --fd N``, started and owned by
a node's executor (engine/executor.py), which holds the other end of socket ``N``.

It joins the node's group, builds its ModelRunner on its shard and says it is ready, then follows
rank 0's messages: allocate its KV pool, run the profile or the prefill timing, fill or clear
the LoRA slot rank 0 names, follow each step's plan, shut down. It never schedules. It ignores
SIGINT and SIGTERM (rank 0 drains the node, then tells it to stop) and exits when rank 0's
socket closes. An error is reported to rank 0 on the socket, and the worker exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import traceback

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.executor import SharedPool, recv_frame, send_frame
from pdserve.engine.model_runner import ModelRunner, StepPlan
from pdserve.engine.parallel import close_parallel, init_parallel
from pdserve.engine.platform import resolve_platform
from pdserve.protocol.kv_layout import KVCacheSpec

log = logging.getLogger("pdserve.engine.worker")


def serve(sock: socket.socket) -> int:
    init = recv_frame(sock)
    if init is None:
        return 1
    rank = init["rank"]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s %(message)s")
    if init["threads"]:
        torch.set_num_threads(init["threads"])
    config = EngineConfig(**init["config"])
    platform = resolve_platform(_rank_device(config.device, rank))
    parallel = init_parallel(init["tp_size"], rank, init["init_method"], init["backend"], init["timeout_s"])
    try:
        runner = ModelRunner(
            ModelConfig.from_path(init["model"]), config, platform=platform, parallel=parallel
        )
        send_frame(sock, {"ready": True})
        while (message := recv_frame(sock)) is not None:
            op = message["op"]
            if op == "step":
                runner.follow(StepPlan.from_wire(message["plan"]))
            elif op == "allocate_kv":
                _allocate(runner, sock, KVCacheSpec(**message["spec"]))
            elif op == "profile":
                runner.profile(*message["args"])
            elif op == "time_prefill":
                runner.time_prefill(message["num_tokens"])
            elif op in ("lora_fill", "lora_clear"):
                _change_slot(runner, message)
            elif op == "shutdown":
                break
            else:
                raise ValueError(f"unknown message {op!r}")
    finally:
        close_parallel(parallel)
    return 0


def _allocate(runner: ModelRunner, sock: socket.socket, spec: KVCacheSpec) -> None:
    """The KV pool in the memfd rank 0 sends after the message (executor.SharedPool)."""
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not fds:
        raise ValueError("allocate_kv came without its pool's memfd")
    caches = SharedPool(spec, fds[0]).layer_caches()
    runner.allocate_kv(spec, lambda _spec: caches)


def _change_slot(runner: ModelRunner, message: dict) -> None:
    """The LoRA slot rank 0 names := this rank's shard of an adapter (read from its folder), or zeros."""
    lora = runner.lora
    if lora is None:
        raise ValueError(f"{message['op']} on a rank built without LoRA slots")
    if message["op"] == "lora_fill":
        lora.fill(message["slot"], lora.read(message["name"], message["path"]))
    else:
        lora.clear(message["slot"])


def _rank_device(device: str, rank: int) -> str:
    """Rank r's device: the CPU, or the r-th CUDA device from the node's first."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the socket rank 0 holds the other end of")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=args.fd)
    try:
        return serve(sock)
    except Exception as e:  # noqa: BLE001 - any failure ends this rank, and rank 0 is told why
        traceback.print_exc()
        try:
            send_frame(sock, {"error": f"{type(e).__name__}: {str(e)[:500]}"})
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
