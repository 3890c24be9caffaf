"""A node process: the engine and control runtime, built once, and the role served on them.

`pdserve prefill|decode [--colocated]` starts a NodeHost in that role. A ``SetRole`` on the
control socket (the router's ``POST /admin/nodes/{id}/role``, `pdserve role`) switches it
without reloading anything:

    SetRole(prefill ↔ decode/colocated) ─► RoleChange "draining": the record says draining, new
        requests are refused as retryable (the router sends them elsewhere), the old role's work
        finishes (at most ``--drain-timeout``; what is left then fails as draining)
        (and at least two heartbeats: routers have seen the record say draining by then)
    ─► the old role's own parts close (the shipper; the KV receiver and its port), the engine is
        emptied and checked (every block free, or cached), the new role is built on the same
        engine, weights and prefix cache, its record published at once ─► RoleChange "done"
    SetRole(decode ↔ colocated) ─► same work, another name in the registry: done at once

The node's id stays what it was (it names the role it started in). SIGTERM during a switch
drains the node as usual.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.executor.executor import WorkerLost
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer.shared_cache import TORCH_DTYPES, SharedKVCache
from pdserve.node.log import EventLog, forward_own_logs
from pdserve.node.options import NodeOptions
from pdserve.node.parts import NodeParts, ServedRole
from pdserve.node.runtime import NodeRuntime
from pdserve.node.transfer_caches import check_pools_shared
from pdserve.protocol.messages import RoleChange, RolePhase, SetRole
from pdserve.protocol.registry import Role
from pdserve.protocol.tracing import open_tracer


@dataclasses.dataclass(slots=True)
class _Switch:
    role: Role
    asked: list[SetRole]  # each is told when it is done
    started: float  # time.monotonic()
    # not before routers have seen the record say draining: till then they may route new work here
    drained_after: float
    deadline: float


EXIT_RANK_LOST = 3  # the exit status of a node whose tensor-parallel rank was lost


def build_role(parts: NodeParts) -> ServedRole:
    if parts.opts.role is Role.PREFILL:
        from pdserve.prefill_node.server import PrefillNode

        return PrefillNode(parts)
    from pdserve.decode_node.server import DecodeNode

    return DecodeNode(parts)


class NodeHost:
    def __init__(self, opts: NodeOptions, engine_config: EngineConfig) -> None:
        check_pools_shared(engine_config)  # before anything loads: every role moves KV
        log = EventLog(opts.node_id)
        forward_own_logs(log)  # before the engine: its start-up records too
        self.parts = NodeParts(opts, log, None, None)  # type: ignore[arg-type]  # engine and runtime: filled in below
        # named by the role it starts in, as its id is; each span names the role serving now
        self.parts.tracer = open_tracer(f"pdserve-{opts.role}", opts.node_id, opts.otlp_traces_endpoint)
        # A prefill node's KV cache in host memory lives in shared memory, so same-host decode
        # nodes copy blocks straight out of it. The engine calls the factory only for a pool in
        # host memory; a device pool (and a private one) leaves the cache None.
        # A tensor-parallel node's pools are its ranks' shared memory (engine/executor/executor.py;
        # on a device it is refused above): its KV goes on the socket or the staging ring, the
        # one-copy path is a single rank's.
        single = engine_config.tensor_parallel_size == 1
        factory = self._shared_cache if opts.role is Role.PREFILL and single else None
        # busy is not dead: the engine's layers vouch for the node (once it serves)
        self.parts.engine = LLMEngine(engine_config, kv_cache_factory=factory, on_layer=self._in_step)
        # its first record says how fast it prefills; the first guided request need not build
        # the grammar engine
        speed = self.parts.engine.warm_up()
        log("prefill_speed_measured", tokens_per_s=round(speed))
        self.parts.runtime = NodeRuntime(opts, log)
        self.role = build_role(self.parts)
        self.switch: _Switch | None = None
        self.ready_file: str | None = None

    def _in_step(self) -> None:
        runtime = self.parts.runtime
        if runtime is not None:  # None while the engine starts
            runtime.in_step()

    def _shared_cache(self, spec):
        """The KV cache in shared memory for same-host decode nodes; private memory (and chunks on
        the socket) when none can be had."""
        try:
            self.parts.cache = SharedKVCache(spec)
        except OSError as exc:
            self.parts.log("kv_cache_private", error=repr(exc))
            dtype = TORCH_DTYPES[spec.dtype]
            return [
                (
                    torch.zeros((spec.num_blocks, *spec.block_shape), dtype=dtype),
                    torch.zeros((spec.num_blocks, *spec.block_shape), dtype=dtype),
                )
                for _ in range(spec.num_layers)
            ]
        return self.parts.cache.layer_caches()

    def serve(self, ready_file: str | None = None) -> int:
        runtime = self.parts.runtime
        self.ready_file = ready_file
        runtime.start(self.role.status(), ready_file)
        try:
            runtime.run(self._iterate, lambda: self.role.busy(), self._drain)
        except WorkerLost as exc:  # a rank is gone: never serve with part of the model
            runtime.report_fatal(str(exc))
            self.parts.engine.close(timeout_s=2.0)  # the other workers
            # Gone as a killed node is: no reply per request (the routers see the link drop and
            # retry or migrate each), no drain; the supervisor restarts the whole node.
            os._exit(EXIT_RANK_LOST)
        finally:
            self.role.close("node shut down before the request finished")
            runtime.close()
            self.parts.engine.close()  # its worker ranks stop with it
            if self.parts.tracer is not None:
                self.parts.tracer.close()  # the spans still batched go out
        return 0

    def _drain(self) -> None:
        self.role.start_draining()

    def _iterate(self) -> None:
        failure = self.parts.engine.executor.failure  # a rank lost while idle: the node goes at once
        if failure is not None:
            raise WorkerLost(failure)
        self.role.wait_if_idle()
        for msg in self.parts.runtime.poll_control(0.0):
            if isinstance(msg, SetRole):
                self._on_set_role(msg)
            else:
                self.role.on_control(msg)
        self.role.work()
        switch, now = self.switch, time.monotonic()
        if switch is not None and (
            now >= switch.drained_after and not self.role.busy() or now > switch.deadline
        ):
            self._finish_switch(switch)

    # ----------------------------------------------------------------- role switches
    def _answer(self, msg: SetRole, phase: RolePhase, error: str | None = None) -> None:
        self.parts.runtime.reply(
            msg.reply_addr,
            RoleChange(
                nonce=msg.nonce, node_id=self.parts.opts.node_id, role=msg.role, phase=phase, error=error
            ),
        )

    def _on_set_role(self, msg: SetRole) -> None:
        runtime, current = self.parts.runtime, self.parts.opts.role
        if runtime.draining.is_set():
            return self._answer(msg, RolePhase.REFUSED, "the node is shutting down")
        if self.switch is not None:
            if self.switch.role is not msg.role:
                return self._answer(msg, RolePhase.REFUSED, f"a switch to {self.switch.role} is under way")
            self.switch.asked.append(msg)
            return self._answer(msg, RolePhase.DRAINING)
        if msg.role is current:
            return self._answer(msg, RolePhase.DONE)
        if msg.role.decodes and current.decodes:  # decode <-> colocated: the same work, renamed
            self._become(msg.role, keep_role=True)
            self.parts.log("role_switched", previous=current, role=msg.role, seconds=0.0, forced=False)
            return self._answer(msg, RolePhase.DONE)
        now = time.monotonic()
        seen_draining = now + 2 * self.parts.opts.heartbeat_interval_s  # a beat, and a router's poll
        self.switch = _Switch(msg.role, [msg], now, seen_draining, now + self.parts.opts.drain_timeout_s)
        runtime.switching = True
        self.role.start_draining()
        runtime.publish_soon()
        self.parts.log("role_switch_started", previous=current, role=msg.role)
        self._answer(msg, RolePhase.DRAINING)

    def _finish_switch(self, switch: _Switch) -> None:
        previous, forced = self.parts.opts.role, self.role.busy()
        self.role.close(f"node switched to {switch.role} before the request finished")
        self._empty_engine()
        self._become(switch.role, keep_role=False)
        self.switch = None
        self.parts.log(
            "role_switched",
            previous=previous,
            role=switch.role,
            seconds=round(time.monotonic() - switch.started, 3),
            forced=forced,
        )
        for msg in switch.asked:
            self._answer(msg, RolePhase.DONE)

    def _empty_engine(self) -> None:
        """Nothing of the old role's requests may stay: the new role starts on a pool whose every
        block is free (cached prefixes included: they stay)."""
        engine = self.parts.engine
        left = [*engine.scheduler.held, *engine.requests]
        for rid in left:
            engine.abort_request(rid)
        if left:
            self.parts.log("role_switch_aborted", request_ids=left)
        engine.scheduler.check_integrity()
        stats = engine.stats()
        assert stats.num_blocks_free == stats.num_blocks_total, (
            f"{stats.num_blocks_total - stats.num_blocks_free} blocks held after the old role closed"
        )

    def _become(self, role: Role, keep_role: bool) -> None:
        runtime = self.parts.runtime
        self.parts.opts = dataclasses.replace(self.parts.opts, role=role)
        if keep_role:
            self.role.opts = self.parts.opts
        else:
            self.role = build_role(self.parts)
        runtime.switching = False
        status = self.role.status()
        runtime.set_status(status)
        runtime.publish_soon()
        if self.ready_file:
            runtime.write_ready_file(status, self.ready_file)
