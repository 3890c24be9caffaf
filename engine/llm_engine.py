"""The engine loop: add requests, step the scheduler, run the model, sample, report."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.kv_connector import KVArrival, KVConnector, KVEvents, KVTransfer
from pdserve.engine.core.outputs import EngineStats, RequestOutput, completion_output
from pdserve.engine.core.requests import (
    Aborted,
    QueueFullError,
    Request,
    check_request,
    check_resume,
    expand_forks,
)
from pdserve.engine.core.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.core.sequence import Sequence, SequenceStatus, TokenLogprob
from pdserve.engine.core.step_budget import StepBudgets
from pdserve.engine.core.step_stats import PREFILL_PROBE_TOKENS, StepStats, step_tokens
from pdserve.engine.executor.cuda_graphs import why_eager
from pdserve.engine.executor.executor import Executor
from pdserve.engine.executor.kv_prefault import KVPrefault
from pdserve.engine.executor.model_runner import KVCacheFactory, check_quantization
from pdserve.engine.executor.platform import UNVERIFIED_CUDA, resolve_platform
from pdserve.engine.lora.model import check_lora_family
from pdserve.engine.lora.registry import AdapterRegistry
from pdserve.engine.machine.cpu_share import CpuShare
from pdserve.engine.machine.device import describe_runtime, explain_dtype
from pdserve.engine.machine.resources import usable_cpus
from pdserve.engine.machine.sizing import (
    EngineSizing,
    announce,
    size_engine,
    size_over_ranks,
)
from pdserve.engine.models import check_tensor_parallel, model_class
from pdserve.engine.offload.disk import DiskTier, StoredBlock, namespace_of
from pdserve.engine.offload.host import HostTier
from pdserve.engine.offload.tiers import KVOffload
from pdserve.engine.sampling.beam_search import BeamSearches, num_candidates, stop_ids_of
from pdserve.engine.sampling.draft_model import draft_needs, speculator_for
from pdserve.engine.sampling.logits_rules import LogitsRules
from pdserve.engine.sampling.sampler import Sampler, SamplerInput, prompt_logprobs
from pdserve.engine.sampling.stop_rules import StopRules
from pdserve.protocol.fingerprint import KVFingerprint
from pdserve.protocol.kv_layout import KVCacheSpec
from pdserve.protocol.model_digest import model_digest
from pdserve.protocol.sampling_params import SamplingParams

log = logging.getLogger(__name__)

TIER_WAIT_S = 0.005  # a step with nothing else to do waits this long for offloaded blocks to arrive


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What one ``step`` produced: requests' outputs, and what the node's KV transport must act on."""

    outputs: list[RequestOutput]  # each request the step changed (finished ones leave the engine)
    kv: KVEvents = KVEvents()  # blocks granted to received prompts; KV held for a send


class LLMEngine:
    """One node's engine: add, step, abort and stats (plus adapters, warm-up, idle and close).

    The scheduler owns every request's state and the KV connector (``kv_connector``: what a
    node's transport reads and reports); the executor runs each step on the node's ranks."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer=None,
        kv_cache_factory: KVCacheFactory | None = None,
        group_of_one: bool = False,
        on_layer: Callable[[], None] | None = None,
    ) -> None:
        """``group_of_one``: at one rank, the executor's collectives run over a group of one all
        the same (bench/gpu_probe.py's check of NCCL on one GPU). ``on_layer``: called before
        each decoder layer of every step, the draft model's included (a node's liveness stamp)."""
        # before any allocation: a bad device fails first
        self.platform = platform = resolve_platform(config.device)
        self.device = platform.device
        if config.kv_cache_dtype == "int8" and (
            self.device.type != "cpu" or config.attention_backend == "triton"
        ):
            raise ValueError(f"kv_cache_dtype int8 has CPU kernels only, not on {self.device} or with Triton")
        self.model_config = ModelConfig.from_path(config.model)
        dtype, self.dtype_why = explain_dtype(
            config.dtype, self.device.type, self.model_config.checkpoint_dtype
        )
        # a W8A8 checkpoint runs as int8 where int8 layers run (the CPU), else dequantized in dtype
        stored = self.model_config.checkpoint_quantization if platform.packs_linears else None
        self.config = config = dataclasses.replace(
            config, dtype=dtype, quantization=config.quantization or stored
        )
        check_quantization(config.quantization, platform)
        model_class(self.model_config)  # unsupported architectures fail before any allocation
        if config.enable_lora:
            check_lora_family(self.model_config)  # ... and families without LoRA
        check_tensor_parallel(self.model_config, config.tensor_parallel_size)  # ... and splits
        offloads = config.kv_offload_dir is not None or config.kv_offload_host_mb is not None
        if offloads and config.tensor_parallel_size > 1 and platform.separate_host:
            # ... and tiers that would copy rank pools rank 0 cannot see (rank_pools.PoolsNotShared)
            raise ValueError(
                "kv_offload_dir / kv_offload_host_mb at tensor_parallel_size > 1 on a device: the "
                "tiers copy blocks from every rank's pool, and rank 0 sees only its own device's"
            )
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.sizing = size_engine(config, self.model_config, self.max_model_len)
        tp = config.tensor_parallel_size
        threads = max(1, self.sizing.num_threads // tp)  # each rank's share of the engine's threads
        torch.set_num_threads(threads)
        # the automatic count gives way to other processes' load (engine/machine/cpu_share.py); tensor-
        # parallel ranks keep theirs (they must move in step)
        self.cpu_share = CpuShare(
            threads, usable_cpus(), torch.set_num_threads, enabled=config.num_threads is None and tp == 1
        )
        on_device = platform.mem_info() is not None  # False: the pool is sized from host RAM (size_engine)
        self.executor = Executor(
            self.model_config,
            config,
            platform,
            tp,
            threads,
            collective_timeout_s=config.collective_timeout_s,
            group_of_one=group_of_one,
        )
        self.executor.set_on_layer(on_layer)
        self.runner = self.executor.runner  # rank 0's: its model and KV pool, for inspection
        # the LoRA adapters served here (None: enable_lora is off), lora_modules read at once
        self.lora_adapters = AdapterRegistry(self.executor) if config.enable_lora else None
        try:
            for name, path in config.lora_module_paths:
                self.load_adapter(name, path)
        except Exception:
            self.executor.close()
            raise
        if on_device:
            self.sizing = self._size_device_pool()
        self.kv_spec = self._kv_spec()
        self.executor.allocate_kv(self.kv_spec, kv_cache_factory)
        self.decode_graphs = self._decode_graphs()
        self.block_manager = BlockManager(
            self.kv_spec.num_blocks, config.block_size, config.enable_prefix_caching
        )
        # what a node's transport reads and reports (KVReceiver and the prefill node's shipper),
        # and what the offload tier keeps and brings back
        self.offload = self._offload_tier()
        self.kv_connector = KVConnector(
            config.block_size,
            self.kv_spec.num_blocks,
            self.max_model_len,
            self.add_request,
            self.abort_request,
            self.block_manager,
            self.offload,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.enable_chunked_prefill,
            self.kv_connector,
            self.lora_adapters,
        )
        self.kv_prefault = KVPrefault.for_engine(self.runner.kv_caches, self.kv_spec.num_blocks, config)
        m = self.model_config
        self.sampler = Sampler(LogitsRules(config.model, m.vocab_size, tuple(m.eos_token_ids)))
        extra = describe_runtime(self.runner, self.device, self.cpu_share.active, self.dtype_why)
        if self.platform.kind == "cuda":
            extra += f"; CUDA graphs: {self.decode_graphs}; {UNVERIFIED_CUDA}"
        announce(self.sizing.describe(config, extra))
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}  # not yet done; held ones are the connector's
        self.stop_rules = StopRules(tuple(self.model_config.eos_token_ids), self.max_model_len, tokenizer)
        self.beams = BeamSearches(self.scheduler, self.model_config.eos_token_ids, self.max_model_len)
        self.step_stats = StepStats()  # steps by kind, for the node's metrics
        limits = (self.kv_spec.num_blocks, self.sizing.num_threads, self.max_model_len)
        build = lambda draft_config: LLMEngine(draft_config, on_layer=on_layer)  # noqa: E731
        self.speculator = speculator_for(config, self.model_config, *limits, build_engine=build)
        # each step's token budget, so that steps keep to a time target (chunks shrink when slow)
        min_tokens = min(config.max_num_batched_tokens, config.max_num_seqs + config.block_size)
        self.step_budget = StepBudgets(
            config.max_step_s, config.max_decode_step_s, config.max_num_batched_tokens, min_tokens
        )

    def _graphs_off(self) -> str | None:
        """Why decode steps run eagerly on this engine; None where CUDA graphs capture them."""
        if self.executor.tp_size > 1:
            return "tensor-parallel ranks"
        return why_eager(self.platform.kind, self.config.enforce_eager, self.runner)

    def _decode_graphs(self) -> str:
        """Capture the decode graphs where they apply; the start-up line's word for it."""
        off = self._graphs_off()
        if off is not None:
            return f"off ({off})"
        self.executor.use_decode_graphs(self.config.max_num_seqs, self.max_model_len)
        return f"decode batches up to {self.config.max_num_seqs}"

    def _size_device_pool(self) -> EngineSizing:
        """The pool from what each rank's context and a profile run of the largest step leave of
        this engine's share of its device (engine/machine/sizing.py): the smallest over the ranks."""
        c = self.config
        self.executor.profile(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len)
        # graphs hold a decode step's activations in their own pool: the peak once more
        graphs = self._graphs_off() is None
        memories = [dataclasses.replace(m, graphs=graphs) for m in self.runner.profiled]
        draft = draft_needs(c, self.executor.dtype)  # a draft model's engine comes out of the same share
        block_bytes = self._kv_spec().bytes_per_block
        return size_over_ranks(
            self.sizing, c, self.max_model_len, block_bytes, memories, str(self.device), draft
        )

    def _offload_tier(self) -> KVOffload | None:
        """The offload tiers: host memory in front of a device pool (``kv_offload_host_mb``), and
        the folder ``kv_offload_dir`` under this model's and KV format's namespace (None: neither)."""
        c = self.config
        if c.kv_offload_host_mb is not None and self.platform.kind == "cpu":
            raise ValueError(
                "kv_offload_host_mb: a host-memory tier is for a device pool; this engine's pool is "
                "on the CPU (host memory already): use --kv-offload-dir for a tier beyond it"
            )
        if c.kv_offload_dir is None and c.kv_offload_host_mb is None:
            return None
        host = (
            None
            if c.kv_offload_host_mb is None
            else HostTier(c.kv_offload_host_mb << 20, self.platform.kind == "cuda")
        )
        return KVOffload(self._disk_tier(), host)

    def _disk_tier(self) -> DiskTier | None:
        c = self.config
        if c.kv_offload_dir is None:
            return None
        spec = dataclasses.replace(self.kv_spec, num_kv_heads=self.model_config.num_kv_heads)
        fingerprint = KVFingerprint.from_spec(
            model_digest(c.model), spec, spec.layout, c.dtype, c.quantization
        )
        disk = DiskTier(
            c.kv_offload_dir, namespace_of(dataclasses.asdict(fingerprint)), c.kv_offload_disk_mb << 20
        )
        log.info(
            "kv offload: %s, %d blocks (%.0f MiB of %d), index rebuilt in %.2f s",
            disk.folder,
            disk.num_blocks,
            disk.num_bytes / (1 << 20),
            c.kv_offload_disk_mb,
            disk.rebuilt_in_s,
        )
        return disk

    def _kv_spec(self) -> KVCacheSpec:
        m, c = self.model_config, self.config
        heads = self.runner.num_kv_heads  # rank 0's, the most any rank holds (executor.allocate_kv)
        return KVCacheSpec(
            m.num_layers, self.sizing.num_kv_blocks, c.block_size, heads, m.head_dim, c.kv_dtype
        )

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        resume_output_ids: tuple[int, ...] = (),
        kv_transfer: KVTransfer | None = None,
    ) -> int:
        """Queue a request; its place in the waiting queue. ``kv_transfer``: its part in a KV
        transfer (engine/core/kv_connector.py). SEND stops after the first token and holds the prompt's
        blocks for the transfer (``StepResult.kv.held``); RECEIVE waits for its prompt's KV from a
        peer (its blocks come in ``StepResult.kv.granted``). ``resume_output_ids``: output another
        engine already generated (a migrated request); it is recomputed with the prompt, as after
        a preemption, and generation goes on from there (outputs and logprobs then cover only the
        tokens generated here after it). ValueError naming the field when it cannot be served;
        QueueFullError while the waiting queue is full."""
        max_tokens = self._admit(request_id, prompt_token_ids, params)
        if resume_output_ids:
            check_resume(
                resume_output_ids, params, max_tokens, kv_transfer is not None, self.model_config.vocab_size
            )
        request_max_tokens, seq_params, search = max_tokens, params, self.beams.start(params)
        if kv_transfer is KVTransfer.SEND:
            if search is not None:
                seq_params, search = self.beams.prompt_params(params), None
            elif params.n != 1:
                raise ValueError("n: prefill-only requests take n == 1")
            max_tokens = 1
        elif kv_transfer is KVTransfer.RECEIVE:
            if params.n != 1 and search is None:
                raise ValueError("n: requests prefilled elsewhere take n == 1")
            seq_params = dataclasses.replace(params, prompt_logprobs=None)  # the peer sent them
        seq = Sequence(
            request_id,
            [*prompt_token_ids, *resume_output_ids],
            len(prompt_token_ids),
            seq_params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            max_tokens=max_tokens,
        )
        if kv_transfer is not None:
            beams = params.beam_search is not None
            first = (
                num_candidates(params, len(stop_ids_of(params, self.model_config.eos_token_ids)))
                if beams
                else 0
            )
            self.kv_connector.track(seq, kv_transfer, request_max_tokens, first)
        self.scheduler.add(seq)
        self.requests[request_id] = Request(request_id, list(prompt_token_ids), seq_params, [seq], search)
        return len(self.scheduler.waiting) - 1

    def _admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a new request (its id free, its fields valid, room in the waiting queue); its
        resolved max_tokens. ValueError naming the field, or QueueFullError."""
        if request_id in self.requests or self.kv_connector.is_held(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = check_request(
            prompt_token_ids,
            params,
            self.model_config.vocab_size,
            self.max_model_len,
            self.block_manager,
            self.tokenizer,
            self.sampler.rules,
            self.config.max_num_seqs,
            tuple(self.model_config.eos_token_ids),
            self.lora_adapters,
        )
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        name, path = params.adapter, params.adapter_path
        if name is not None and path is not None and name not in self._registry().names():
            self.load_adapter(name, path)  # a router names the folder of an adapter new here
        return max_tokens

    def abort_request(self, request_id: str) -> Aborted:
        """Stop a request and free its blocks; says where it was, so the caller stops the transfer
        that was writing or reading them too (falsy: no such request). A held request's blocks go
        at once: the caller must know no transfer is reading them any more."""
        if self.scheduler.release(request_id):
            return Aborted.KV_OUTBOUND
        request = self.requests.get(request_id)
        if request is None:
            return Aborted.UNKNOWN
        inbound = request.seqs[0].status is SequenceStatus.WAITING_FOR_KV
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        if request.search is not None:
            request.search.done = True
        self._leave(request)
        return Aborted.KV_INBOUND if inbound else Aborted.LOCAL

    def _leave(self, request: Request) -> None:
        """The request is done here: what the engine kept for it goes (held blocks are the connector's)."""
        del self.requests[request.request_id]
        self.kv_connector.forget(request.request_id)
        if self.lora_adapters is not None:
            self.lora_adapters.release(request.request_id)

    # ------------------------------------------------------------------ LoRA adapters
    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT folder ``path`` as adapter ``name`` (vLLM's load_lora_adapter): read and
        checked now, in a slot at once if one is free, else when a request first needs it.
        ValueError naming the field when it cannot be served (or LoRA is off)."""
        self._registry().add(name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` and free its slot (vLLM's unload_lora_adapter);
        ValueError when it is not loaded, or while a request uses it or waits for it."""
        self._registry().remove(name, self.scheduler.waiting)

    def _registry(self) -> AdapterRegistry:
        if self.lora_adapters is None:
            raise ValueError("enable_lora: LoRA adapters are not enabled on this engine")
        return self.lora_adapters

    # ------------------------------------------------------------------ the node's
    def has_work(self) -> bool:
        """Anything for the next step: a request to compute, a queued remote one it may grant
        (granted ones whose KV is still arriving are not work; nor a waiting head that cannot be
        admitted until something ends), or a report of the KV transport to apply."""
        return self.scheduler.has_work() or self.kv_connector.has_pending

    def note_idle(self) -> None:
        """The caller has nothing for the engine now (a node about to wait for input): with
        ``kv_commit="idle"`` the KV pool commits in the background until the next write, and
        blocks to keep go to the offload tier."""
        self._offload_io()
        self.kv_prefault.idle()

    def warm_up(self, num_tokens: int = PREFILL_PROBE_TOKENS) -> float:
        """Build what a first request would otherwise wait for, before serving: the prefill speed's
        first measure, and the grammar engine (in the background, after it). It times a prompt of
        ``num_tokens`` (within a step's budget and the context) off the pool, so that a node
        reports a speed from its first record (ModelRunner.time_prefill). Tokens per second."""
        n = max(1, min(num_tokens, self.config.max_num_batched_tokens, self.max_model_len - 1))
        seconds = self.executor.time_prefill(n)
        self.step_stats.prefill_rate.seed(n, seconds)
        if self.sampler.rules is not None:  # after the timing, which it would slow
            self.sampler.rules.warm_up_in_background()
        return n / seconds

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the executor's worker ranks (none at tp=1) and the offload tier (what it holds goes
        to disk first, within ``timeout_s``); the engine cannot step after it."""
        if self.offload is not None:
            self._offload_io()
            self.offload.close(timeout_s)
        self.executor.close(timeout_s)

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            max_model_len=self.max_model_len,
            device=str(self.device),
            num_blocks_total=bm.num_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=bm.num_cached_free_blocks,
            num_blocks_committed=self.kv_prefault.num_committed(bm.high_water),
            torch_threads=self.cpu_share.threads,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_receiving=len(sched.receiving),
            num_held=len(sched.held),
            num_queued_prefill_tokens=self._num_queued_prefill_tokens(),
            step_stats=self.step_stats.snapshot(),
            prefill_tokens_per_s=self.step_stats.prefill_rate.tokens_per_s,
            step_target_s=self.step_budget.target_s,
            speculation=None if self.speculator is None else self.speculator.stats.to_dict(),
            adapters=() if self.lora_adapters is None else self.lora_adapters.stats(sched.waiting),
            offload=None if self.offload is None else self.offload.stats().to_dict(),
        )

    def _num_queued_prefill_tokens(self) -> int:
        """Prompt tokens to compute here: waiting requests' (not those whose KV comes from a peer),
        and running ones' unfinished chunks."""
        sched = self.scheduler
        queued = sum(s.num_uncomputed_tokens for s in sched.waiting if s.status is SequenceStatus.WAITING)
        return queued + sum(s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1)

    # ------------------------------------------------------------------ the loop
    def step(self) -> StepResult:
        """One iteration: apply what the KV transport reported, grant the reservations heading
        the queue (returned at once, before anything computes, so that their senders start),
        else schedule, run the model, sample."""
        if self.config.debug_checks:
            self.scheduler.check_integrity()
        start = time.perf_counter()
        outputs = self._land(self.kv_connector.take_arrived())
        if self.scheduler.grant_head():
            self.kv_prefault.advance(self.block_manager.high_water)  # the KV lands before any step
            self._offload_io()
            return StepResult(outputs, self.kv_connector.take_events())
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.scheduler.waiting, self.max_model_len)
        decoding = any(s.num_uncomputed_tokens == 1 for s in self.scheduler.running)
        # never-used blocks while their pages are committed, else reuse (engine/core/block_manager.py)
        self.block_manager.fresh_limit = self.kv_prefault.fresh_limit()
        sched = self.scheduler.schedule(self.step_budget.tokens(decoding))
        outputs += self._refuse(sched.refused)
        if sched.granted or sched.scheduled:
            self.kv_prefault.advance(self.block_manager.high_water)  # commits the pages it will write
        self._offload_io()  # before anything writes a block that was freed with content to keep
        if sched.scheduled:
            outputs += self._timed_run(sched, start)
        else:  # nothing to run: a waiting request's offloaded blocks may be about to arrive
            self.kv_connector.wait_for_tier(TIER_WAIT_S)
        return StepResult(outputs, self.kv_connector.take_events())

    def _timed_run(self, sched: SchedulerOutput, start: float) -> list[RequestOutput]:
        """``_run``, and what the step's time says: the step counts, the next chunk's budget (a
        step with prompt tokens), a draft row's cost (a decode step)."""
        tokens = step_tokens(sched.scheduled)  # (prompt, decode), before they count as computed
        outputs = self._run(sched)
        seconds = time.perf_counter() - start
        self.step_stats.observe(*tokens, seconds)
        if tokens[0]:
            self.step_budget.observe(*tokens, seconds)
        elif self.speculator is not None:
            self.speculator.observe_step(tokens[1], seconds)
        return outputs

    def _offload_io(self) -> None:
        """The offload tier's copies, between a schedule and anything that writes the pool: blocks
        to keep are copied out first (freed or preempted ones the schedule may have handed on),
        then the blocks the schedule took from the tier are filled."""
        saves = self.kv_connector.take_saves()
        if saves:
            payloads = self.executor.read_blocks([block_id for block_id, _, _ in saves])
            self.kv_connector.keep(
                [StoredBlock(h, t, p) for (_, h, t), p in zip(saves, payloads, strict=True)]
            )
        loads = self.kv_connector.take_loads()
        if loads:
            self.executor.write_blocks(
                [block_id for block_id, _ in loads], torch.stack([p for _, p in loads])
            )

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Run the scheduled rows through the model and turn their logits into tokens (samples,
        beams' candidates, drafts' verification); the outputs of the requests it changed."""
        self.cpu_share.tick()
        logits, sampled, prompt_hidden = self.executor.execute(sched)
        for seq, hidden in prompt_hidden:
            self._score_prompt(seq, hidden)
        for item in sched.scheduled:
            if not item.seq.draft_token_ids:  # a drafted decode's count waits for its verification
                item.seq.num_computed_tokens += item.num_new_tokens
                self.block_manager.commit_computed(item.seq)
        # each sampled sequence's first logits row (a drafted one has one more row per draft)
        first_rows = list(itertools.accumulate((1 + len(s.draft_token_ids) for s in sampled[:-1]), initial=0))
        rows, seqs = expand_forks(sampled, self.requests, self.block_manager, self.scheduler)
        drafted = [(seq, first_rows[i]) for i, seq in enumerate(sampled) if seq.draft_token_ids]
        all_logits = logits
        if len(seqs) != len(sampled) or drafted:  # else every row is sampled once: no copy of the logits
            picked = [first_rows[r] for r in rows]
            logits = all_logits[torch.tensor(picked, dtype=torch.int64, device=self.device)]
        logits, seqs, beam_requests = self.beams.take_rows(logits, seqs, self.requests)
        touched = {r.request_id: r for r in beam_requests}
        self._sample(logits, seqs, touched)
        if drafted:
            assert self.speculator is not None  # only a speculator drafts
            sample = lambda rows, sequences: self._sample(rows, sequences, touched)  # noqa: E731
            self.speculator.verify(all_logits, drafted, sample, self.block_manager)
        return [self._output(r) for r in touched.values() if r.search is None or r.finished]

    def _land(self, arrived: list[KVArrival]) -> list[RequestOutput]:
        """Received prompts whose KV landed: computed now, each takes the first token its peer
        sampled (a beam search, its first step from the peer's candidates) and decodes from this
        step on. The outputs of those that first token ended."""
        outputs = []
        for arrival in arrived:
            request = self.requests[arrival.request_id]
            seq = request.seqs[0]
            assert seq.status is SequenceStatus.WAITING_FOR_KV, f"{arrival.request_id} is {seq.status}"
            self.scheduler.kv_arrived(seq)
            if request.search is not None:
                self.beams.land(request, arrival.first_logprob)
            else:
                self._take_token(seq, arrival.first_token, arrival.first_logprob)
            if request.finished:
                outputs.append(self._output(request))
        return outputs

    def _refuse(self, refused: list[tuple[Sequence, str]]) -> list[RequestOutput]:
        """Requests the scheduler's admission refused for good (an adapter whose folder can no
        longer be read): they end aborted, each with its output."""
        outputs = []
        for seq, why in refused:
            log.error("request %s: %s; aborted", seq.request_id, why)
            request = self.requests[seq.request_id]
            self.abort_request(seq.request_id)
            ended = [completion_output(s, self.tokenizer) for s in request.seqs]
            outputs.append(RequestOutput(seq.request_id, request.prompt_token_ids, ended, True, 0))
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict[str, Request]) -> None:
        """Draw each sequence's next token from its row of ``logits``, append it, check the stop rules."""
        inputs = [SamplerInput(s, self.stop_rules.banned(s)) for s in seqs]
        for seq, (token_id, logprob) in zip(seqs, self.sampler.sample(logits, inputs), strict=True):
            self._take_token(seq, token_id, logprob)
            touched[seq.request_id] = self.requests[seq.request_id]

    def _take_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        """Append ``seq``'s next token (sampled here, or by the node that ran its prompt) and
        its logprobs when it asked for them, then apply the stop rules."""
        seq.token_ids.append(token_id)
        if logprob is not None and seq.params.logprobs is not None:
            seq.logprobs.append(logprob)  # one per output token
        status = self.stop_rules.check(seq, token_id)
        if status is not None:
            self._finish(seq, status)

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Prompt logprobs of the positions ``hidden`` holds, the next ones ``seq`` is due."""
        first, num_top = len(seq.prompt_logprobs), seq.params.prompt_logprobs
        assert num_top is not None  # only sequences that asked have prompt rows
        for start, logits in self.executor.prompt_logits(hidden):
            at = first + start + 1  # the prompt token these rows score
            next_ids = seq.token_ids[at : at + logits.shape[0]]
            seq.prompt_logprobs += prompt_logprobs(logits, next_ids, num_top)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)  # a sent prompt's sequence may stay HELD_FOR_TRANSFER
        self.sampler.forget(seq)
        self.stop_rules.forget(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)

    # ------------------------------------------------------------------ outputs
    def _output(self, request: Request) -> RequestOutput:
        """The request's output so far; a finished one leaves the engine."""
        outputs = [completion_output(seq, self.tokenizer) for seq in request.seqs]
        finished = request.finished
        if finished:
            self._leave(request)
        first = request.seqs[0]
        scored = first.params.prompt_logprobs is not None and not first.needs_prompt_logprobs
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            outputs,
            finished,
            first.num_cached_tokens if request.search is None else request.search.num_cached_tokens,
            list(first.prompt_logprobs) if scored else None,
        )
