"""The engine loop: add requests, step the scheduler, run the model, sample, report."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from pdserve.engine.beam_search import BeamSearch, candidates_of, fork_beams, num_candidates, stop_ids_of
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cpu_share import CpuShare
from pdserve.engine.cuda_graphs import why_eager
from pdserve.engine.device import describe_runtime, explain_dtype
from pdserve.engine.draft_model import draft_needs, speculator_for
from pdserve.engine.executor import Executor
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.kv_prefault import KVPrefault
from pdserve.engine.logits_rules import LogitsRules
from pdserve.engine.lora.model import check_lora_family
from pdserve.engine.lora.registry import AdapterRegistry
from pdserve.engine.model_runner import KVCacheFactory
from pdserve.engine.models import check_tensor_parallel, model_class
from pdserve.engine.outputs import EngineStats, RequestOutput, completion_output
from pdserve.engine.platform import UNVERIFIED_CUDA, resolve_platform
from pdserve.engine.requests import (
    Aborted,
    QueueFullError,
    Request,
    check_request,
    check_resume,
    expand_forks,
)
from pdserve.engine.resources import usable_cpus
from pdserve.engine.sampler import Sampler, SamplerInput, prompt_logprobs
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus, TokenLogprob
from pdserve.engine.sizing import EngineSizing, announce, measure_device, size_device_pool, size_engine
from pdserve.engine.step_budget import StepBudgets
from pdserve.engine.step_stats import PREFILL_PROBE_TOKENS, StepStats, step_tokens
from pdserve.engine.stop_rules import StopRules
from pdserve.protocol.kv_layout import KVCacheSpec
from pdserve.protocol.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer=None,
        kv_cache_factory: KVCacheFactory | None = None,
        group_of_one: bool = False,
    ) -> None:
        """``group_of_one``: at one rank, the executor's collectives run over a group of one all
        the same (bench/gpu_probe.py's check of NCCL on one GPU)."""
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
        self.config = config = dataclasses.replace(config, dtype=dtype)
        model_class(self.model_config)  # unsupported architectures fail before any allocation
        if config.enable_lora:
            check_lora_family(self.model_config)  # ... and families without LoRA
        check_tensor_parallel(self.model_config, config.tensor_parallel_size)  # ... and splits
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.sizing = size_engine(config, self.model_config, self.max_model_len)
        tp = config.tensor_parallel_size
        threads = max(1, self.sizing.num_threads // tp)  # each rank's share of the engine's threads
        torch.set_num_threads(threads)
        # the automatic count gives way to other processes' load (engine/cpu_share.py); tensor-
        # parallel ranks keep theirs (they must move in step)
        self.cpu_share = CpuShare(
            threads, usable_cpus(), torch.set_num_threads, enabled=config.num_threads is None and tp == 1
        )
        at_start = platform.mem_info()  # None: the pool is sized from host RAM (size_engine)
        self.executor = Executor(
            self.model_config,
            config,
            platform,
            tp,
            threads,
            collective_timeout_s=config.collective_timeout_s,
            group_of_one=group_of_one,
        )
        self.runner = self.executor.runner  # rank 0's: its model and KV pool, for inspection
        # the LoRA adapters served here (None: enable_lora is off), lora_modules read at once
        self.lora_adapters = AdapterRegistry(self.executor) if config.enable_lora else None
        try:
            for name, path in config.lora_module_paths:
                self.load_adapter(name, path)
        except Exception:
            self.executor.close()
            raise
        if at_start is not None:
            self.sizing = self._size_device_pool(at_start)
        self.kv_spec = self._kv_spec()
        self.executor.allocate_kv(self.kv_spec, kv_cache_factory)
        self.decode_graphs = self._decode_graphs()
        self.block_manager = BlockManager(
            self.kv_spec.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.enable_chunked_prefill,
        )
        self.kv_prefault = KVPrefault.for_engine(self.runner.kv_caches, self.kv_spec.num_blocks, config)
        m = self.model_config
        self.sampler = Sampler(LogitsRules(config.model, m.vocab_size, tuple(m.eos_token_ids)))
        extra = describe_runtime(self.runner, self.device, self.cpu_share.active, self.dtype_why)
        if self.platform.kind == "cuda":
            extra += f"; CUDA graphs: {self.decode_graphs}; {UNVERIFIED_CUDA}"
        announce(self.sizing.describe(config, extra))
        self.tokenizer = tokenizer
        self.kv_connector = KVConnector(self)  # what a node's KV transfer asks of this engine
        self.requests: dict[str, Request] = {}  # not yet done; held ones are the scheduler's (held)
        self.stop_rules = StopRules(tuple(self.model_config.eos_token_ids), self.max_model_len, tokenizer)
        self.step_stats = StepStats()  # steps by kind, for the node's metrics
        limits = (self.kv_spec.num_blocks, self.sizing.num_threads, self.max_model_len)
        self.speculator = speculator_for(config, self.model_config, *limits, build_engine=LLMEngine)
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

    def _size_device_pool(self, at_start: tuple[int, int]) -> EngineSizing:
        """The pool from what the weights and a profile run of the largest step leave of this
        engine's share of the device (engine/sizing.py)."""
        c = self.config
        profile = lambda: self.executor.profile(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len)  # noqa: E731
        # graphs hold a decode step's activations in their own pool: the peak once more
        memory = measure_device(self.platform, profile, at_start, graphs=self._graphs_off() is None)
        draft = draft_needs(c, self.executor.dtype)  # a draft model's engine comes out of the same share
        block_bytes = self._kv_spec().bytes_per_block
        return size_device_pool(
            self.sizing, c, self.max_model_len, block_bytes, memory, str(self.device), draft
        )

    def _kv_spec(self) -> KVCacheSpec:
        m, c = self.model_config, self.config
        heads = self.runner.num_kv_heads  # rank 0's, the most any rank holds (executor.allocate_kv)
        return KVCacheSpec(
            m.num_layers, self.sizing.num_kv_blocks, c.block_size, heads, m.head_dim, c.kv_dtype
        )

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request; returns its resolved max_tokens. Raises ValueError naming the field."""
        return check_request(
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

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a new request (its id free, its fields valid, room in the waiting queue); its
        resolved max_tokens. ValueError naming the field, or QueueFullError."""
        if request_id in self.requests or request_id in self.scheduler.held:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        if self.num_waiting() >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        name, path = params.adapter, params.adapter_path
        if name is not None and path is not None and name not in self.adapters():
            self.load_adapter(name, path)  # a router names the folder of an adapter new here
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prefill_only: bool = False,
        resume_output_ids: tuple[int, ...] = (),
    ) -> None:
        """Queue a request. ``prefill_only``: stop after the first token and hold the KV blocks
        (HELD_FOR_TRANSFER) until ``kv_connector.release``. ``resume_output_ids``: output another engine
        already generated (a migrated request); it is recomputed with the prompt, as after a
        preemption, and generation goes on from there (outputs and logprobs then cover only the
        tokens generated here after it)."""
        max_tokens = self.admit(request_id, prompt_token_ids, params)
        if resume_output_ids:
            check_resume(resume_output_ids, params, max_tokens, prefill_only, self.model_config.vocab_size)
        request_max_tokens = max_tokens
        seq_params = params
        if prefill_only:
            if params.beam_search is not None:
                seq_params = self._first_beam_step(params)
            elif params.n != 1:
                raise ValueError("n: prefill-only requests take n == 1")
            max_tokens = 1
        seq = Sequence(
            request_id,
            [*prompt_token_ids, *resume_output_ids],
            len(prompt_token_ids),
            seq_params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            max_tokens=max_tokens,
            hold_kv=prefill_only,
            request_max_tokens=request_max_tokens,
        )
        self.queue(seq)
        self.requests[request_id] = Request(
            request_id, list(prompt_token_ids), seq_params, [seq], self.search_for(params, prefill_only)
        )

    def queue(self, seq: Sequence, remote: bool = False) -> int:
        """A new request's sequence into the scheduler's waiting FIFO (``remote``: WAITING_FOR_KV,
        its prompt KV computed elsewhere), its adapter's slot pinned first; while no slot can be
        had, into the adapters' own FIFO until one frees (``_admit_adapter_waiting``). Its place
        in the queue. ValueError when its adapter's folder cannot be read again."""
        if remote:
            seq.status = SequenceStatus.WAITING_FOR_KV
        adapters = self.lora_adapters
        if adapters is not None and seq.params.adapter is not None and not adapters.admit_or_wait(seq):
            return self.num_waiting() - 1
        if remote:
            self.scheduler.add_remote(seq)
        else:
            self.scheduler.add(seq)
        return len(self.scheduler.waiting) - 1

    def num_waiting(self) -> int:
        """Requests queued: in the scheduler's FIFO, and waiting for an adapter slot."""
        adapters = self.lora_adapters
        return len(self.scheduler.waiting) + (0 if adapters is None else adapters.num_waiting)

    def _admit_adapter_waiting(self) -> list[RequestOutput]:
        """Requests that waited for an adapter slot, into the scheduler's FIFO now that one is
        free; one whose adapter's folder can no longer be read ends aborted (its output)."""
        if self.lora_adapters is None or not self.lora_adapters.num_waiting:
            return []
        admitted, failed = self.lora_adapters.admit_waiting()
        for seq in admitted:
            if seq.status is SequenceStatus.WAITING_FOR_KV:
                self.scheduler.add_remote(seq)
            else:
                self.scheduler.add(seq)
        outputs = []
        for seq, why in failed:
            log.error("request %s: %s; aborted", seq.request_id, why)
            request = self.requests[seq.request_id]
            self.abort_request(seq.request_id)
            ended = [completion_output(s, self.tokenizer) for s in request.seqs]
            outputs.append(RequestOutput(seq.request_id, request.prompt_token_ids, ended, True, 0))
        return outputs

    # ------------------------------------------------------------------ LoRA adapters
    def load_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT folder ``path`` as adapter ``name`` (vLLM's load_lora_adapter): read and
        checked now, in a slot at once if one is free, else when a request first needs it.
        ValueError naming the field when it cannot be served (or LoRA is off)."""
        self._registry().add(name, path)

    def unload_adapter(self, name: str) -> None:
        """Stop serving adapter ``name`` and free its slot (vLLM's unload_lora_adapter);
        ValueError when it is not loaded, or while a request uses it or waits for it."""
        self._registry().remove(name)

    def adapters(self) -> tuple[str, ...]:
        """The adapters served (lora_modules and load_adapter, less unload_adapter), whether
        they hold a slot now or are read again on demand."""
        return () if self.lora_adapters is None else self.lora_adapters.names()

    def _registry(self) -> AdapterRegistry:
        if self.lora_adapters is None:
            raise ValueError("enable_lora: LoRA adapters are not enabled on this engine")
        return self.lora_adapters

    def search_for(self, params: SamplingParams, prefill_only: bool = False) -> BeamSearch | None:
        """A beam-search request's search (none where only its prompt runs here)."""
        if params.beam_search is None or prefill_only:
            return None
        return BeamSearch(params, self.model_config.eos_token_ids, self.max_model_len)

    def _first_beam_step(self, params: SamplingParams) -> SamplingParams:
        """A beam-search prompt that runs here for another engine: its first token's logprobs list
        every candidate the search's first step needs (the other engine takes them from the KV
        transfer's first logprobs), and no token ends it here."""
        stop_ids = stop_ids_of(params, self.model_config.eos_token_ids)
        num_top = max(num_candidates(params, len(stop_ids)), params.logprobs or 0)
        return dataclasses.replace(
            params, n=1, beam_search=None, logprobs=num_top, ignore_eos=True, stop_token_ids=()
        )

    def has_work(self) -> bool:
        """Anything for the next step: a request to compute, or a queued remote one it may grant
        (granted ones whose KV is still arriving are not work; nor a waiting head that cannot be
        admitted until something ends), or a request waiting for an adapter slot that it can have."""
        waiting = self.lora_adapters is not None and self.lora_adapters.can_admit_waiting()
        return self.scheduler.has_work() or waiting

    def on_progress(self, callback) -> None:
        """``callback()`` runs before each decoder layer of every step (a node's liveness stamp),
        the draft model's steps included."""
        self.executor.set_on_layer(callback)
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.engine.on_progress(callback)

    def note_idle(self) -> None:
        """The caller has nothing for the engine now (a node about to wait for input): with
        ``kv_commit="idle"`` the KV pool commits in the background until the next write."""
        self.kv_prefault.idle()

    def abort_request(self, request_id: str) -> Aborted:
        """Stop a request and free its blocks; says where it was, so the caller stops the transfer
        that was writing or reading them too (falsy: no such request). A held request's blocks go
        at once: the caller must know no transfer is reading them any more."""
        if self.kv_connector.release(request_id):
            return Aborted.KV_OUTBOUND
        request = self.requests.pop(request_id, None)
        if request is None:
            return Aborted.UNKNOWN
        if self.lora_adapters is not None:
            self.lora_adapters.release(request_id)
        inbound = request.seqs[0].status is SequenceStatus.WAITING_FOR_KV
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        if request.search is not None:
            request.search.done = True
        return Aborted.KV_INBOUND if inbound else Aborted.LOCAL

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the executor's worker ranks (none at tp=1); the engine cannot step after it."""
        self.executor.close(timeout_s)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def kv_caches(self) -> list:
        """The KV pool, per layer (K, V) [num_blocks, block_size, kv_heads, head_dim]: what a
        node's KV transfer reads and writes."""
        return self.executor.kv_caches

    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens to compute here: waiting requests' (not those whose KV comes from a peer),
        and running ones' unfinished chunks."""
        sched = self.scheduler
        waiting = [*sched.waiting, *(() if self.lora_adapters is None else self.lora_adapters.waiting)]
        queued = sum(s.num_uncomputed_tokens for s in waiting if s.status is SequenceStatus.WAITING)
        return queued + sum(s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1)

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
            num_waiting=self.num_waiting(),
            num_receiving=len(sched.receiving),
            num_held=len(sched.held),
            num_queued_prefill_tokens=self.num_queued_prefill_tokens(),
            step_stats=self.step_stats.snapshot(),
            prefill_tokens_per_s=self.step_stats.prefill_rate.tokens_per_s,
            step_target_s=self.step_budget.target_s,
            speculation=None if self.speculator is None else self.speculator.stats.to_dict(),
            adapters=() if self.lora_adapters is None else self.lora_adapters.stats(),
        )

    def measure_prefill_speed(self, num_tokens: int = PREFILL_PROBE_TOKENS) -> float:
        """Time a prompt of ``num_tokens`` (within a step's budget and the context) through the
        model, off the pool, as the prefill speed's first measure: a node reports a speed from
        its first record, so a router divides a first burst's queue by a measured speed rather
        than by none (ModelRunner.time_prefill). Tokens per second."""
        n = max(1, min(num_tokens, self.config.max_num_batched_tokens, self.max_model_len - 1))
        seconds = self.executor.time_prefill(n)
        self.step_stats.prefill_rate.seed(n, seconds)
        return n / seconds

    def warm_up_in_background(self) -> None:
        """Build what the first request of a kind would otherwise wait for (the grammar engine)."""
        if self.sampler.rules is not None:
            self.sampler.rules.warm_up_in_background()

    # ------------------------------------------------------------------ the loop
    def check_integrity(self) -> None:
        """Assert the block pool's invariants, ref counts against every sequence holding blocks."""
        sched = self.scheduler
        holders = [*sched.running, *sched.receiving, *sched.held.values()]
        self.block_manager.check_integrity(holders)
        if self.lora_adapters is not None:
            self.lora_adapters.check_integrity(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.config.debug_checks:
            self.check_integrity()
        start = time.perf_counter()
        ended = self._admit_adapter_waiting()  # before the schedule: a slot freed by the last step
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.scheduler.waiting, self.max_model_len)
        decoding = any(s.num_uncomputed_tokens == 1 for s in self.scheduler.running)
        # never-used blocks while their pages are committed, else reuse (engine/block_manager.py)
        self.block_manager.fresh_limit = self.kv_prefault.fresh_limit()
        sched = self.scheduler.schedule(self.step_budget.tokens(decoding))
        if sched.granted:
            self.kv_connector.granted(sched.granted)
        if not sched.scheduled:
            return ended
        self.cpu_share.tick()
        self.kv_prefault.advance(self.block_manager.high_water)  # commits the pages it will write
        logits, sampled, prompt_hidden = self.executor.execute(sched)
        for seq, hidden in prompt_hidden:
            self._score_prompt(seq, hidden)
        tokens = step_tokens(sched.scheduled)  # (prompt, decode), before they count as computed
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
        touched: dict[str, Request] = {}
        logits, seqs = self._take_beam_rows(logits, seqs, touched)
        self._sample(logits, seqs, touched)
        if drafted:
            assert self.speculator is not None  # only a speculator drafts
            sample = lambda rows, sequences: self._sample(rows, sequences, touched)  # noqa: E731
            self.speculator.verify(all_logits, drafted, sample, self.block_manager)
        for request in touched.values():
            if request.search is not None:
                self.advance_beams(request)
        outputs = ended + [self.output(r) for r in touched.values() if r.search is None or r.finished]
        seconds = time.perf_counter() - start
        self.step_stats.observe(*tokens, seconds)
        if tokens[0]:  # a step with prompt tokens: what the budget of the next chunk follows
            self.step_budget.observe(*tokens, seconds)
        elif self.speculator is not None:  # a decode step: what a draft row costs
            self.speculator.observe_step(tokens[1], seconds)
        return outputs

    def _take_beam_rows(
        self, logits: torch.Tensor, seqs: list[Sequence], touched: dict[str, Request]
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """Beams' rows become their candidates; the rest of ``logits`` and ``seqs`` are sampled."""
        beam_rows = [r for r, s in enumerate(seqs) if self.requests[s.request_id].search is not None]
        if not beam_rows:
            return logits, seqs
        beams = [seqs[r] for r in beam_rows]
        num = max(self.requests[b.request_id].search.num_candidates for b in beams)  # type: ignore[union-attr]
        num = max(num, *(b.params.logprobs or 0 for b in beams))
        index = torch.tensor(beam_rows, dtype=torch.int64, device=logits.device)
        for beam, cands in zip(beams, candidates_of(logits[index], num), strict=True):
            beam.beam_candidates = cands
            touched[beam.request_id] = self.requests[beam.request_id]
        taken = set(beam_rows)
        rest = [r for r in range(len(seqs)) if r not in taken]
        keep = torch.tensor(rest, dtype=torch.int64, device=logits.device)
        return logits[keep], [seqs[r] for r in rest]

    def advance_beams(self, request: Request) -> None:
        """One step of the request's search once every running beam has its candidates; at its
        end the answer (the best finished beams) takes the beams' place."""
        search = request.search
        assert search is not None
        beams = request.seqs
        if search.done or any(b.beam_candidates is None for b in beams):
            return
        if beams[0].num_output_tokens == 0:  # the prompt: its hit is every beam's
            request.num_cached_tokens = beams[0].num_cached_tokens
        extensions = search.advance(beams)
        request.seqs = fork_beams(beams, extensions, self.block_manager, self.scheduler)
        if search.done:
            self._answer_beams(request)

    def _answer_beams(self, request: Request) -> None:
        search = request.search
        assert search is not None
        search.done = True
        running = [s for s in request.seqs if not s.is_finished]
        answer = search.results(running)
        for seq in running:
            self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        request.seqs = [
            Sequence(
                request.request_id,
                hyp.token_ids,
                len(request.prompt_token_ids),
                request.params,
                index=index,
                status=hyp.status,
                finish_status=hyp.status,
                logprobs=hyp.logprobs,
                num_cached_tokens=request.num_cached_tokens,
            )
            for index, hyp in enumerate(answer)
        ]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict[str, Request]) -> None:
        """Draw each sequence's next token from its row of ``logits``, append it, check the stop rules."""
        inputs = [SamplerInput(s, self.stop_rules.banned(s)) for s in seqs]
        for seq, (token_id, logprob) in zip(seqs, self.sampler.sample(logits, inputs), strict=True):
            self.take_token(seq, token_id, logprob)
            touched[seq.request_id] = self.requests[seq.request_id]

    def take_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        """Append ``seq``'s next token (sampled here, or by the node that ran its prompt) and
        its logprobs when it asked for them, then apply the stop rules."""
        seq.token_ids.append(token_id)
        if logprob is not None and seq.params.logprobs is not None:
            seq.logprobs.append(logprob)  # one per output token
        self._check_stop(seq, token_id)

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Prompt logprobs of the positions ``hidden`` holds, the next ones ``seq`` is due."""
        first, num_top = len(seq.prompt_logprobs), seq.params.prompt_logprobs
        assert num_top is not None  # only sequences that asked have prompt rows
        for start, logits in self.executor.prompt_logits(hidden):
            at = first + start + 1  # the prompt token these rows score
            next_ids = seq.token_ids[at : at + logits.shape[0]]
            seq.prompt_logprobs += prompt_logprobs(logits, next_ids, num_top)

    def _check_stop(self, seq: Sequence, token_id: int) -> None:
        status = self.stop_rules.check(seq, token_id)
        if status is not None:
            self._finish(seq, status)

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        self.scheduler.finish(seq, status)  # a prefill-only sequence stays HELD_FOR_TRANSFER
        self.sampler.forget(seq)
        self.stop_rules.forget(seq)
        if self.speculator is not None:
            self.speculator.forget(seq)

    # ------------------------------------------------------------------ outputs
    def output(self, request: Request) -> RequestOutput:
        """The request's output so far; a finished one leaves the engine."""
        outputs = [completion_output(seq, self.tokenizer) for seq in request.seqs]
        finished = request.finished
        if finished:
            del self.requests[request.request_id]
            if self.lora_adapters is not None:
                self.lora_adapters.release(request.request_id)
        first = request.seqs[0]
        scored = first.params.prompt_logprobs is not None and not first.needs_prompt_logprobs
        return RequestOutput(
            request.request_id,
            request.prompt_token_ids,
            outputs,
            finished,
            first.num_cached_tokens if request.search is None else request.num_cached_tokens,
            list(first.prompt_logprobs) if scored else None,
        )
