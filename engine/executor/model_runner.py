"""Owns the model weights and the paged KV cache; turns a SchedulerOutput into logits."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.executor.attention import AttentionMetadata
from pdserve.engine.executor.cuda_graphs import DecodeGraphs
from pdserve.engine.executor.parallel import SINGLE, ParallelState
from pdserve.engine.executor.platform import Platform
from pdserve.engine.layers import moe
from pdserve.engine.lora import LoRALimits, LoRAModel, token_slots_of
from pdserve.engine.machine.device import resolve_attention_backend, resolve_dtype
from pdserve.engine.machine.sizing import DeviceMemory, device_start, measure_device
from pdserve.engine.models import build_model
from pdserve.engine.weights import load_weights
from pdserve.kernels import cpu_int8, cpu_linear, kv_int8
from pdserve.protocol.kv_layout import KVCacheSpec, kv_heads_of

KVCacheFactory = Callable[[KVCacheSpec], list[tuple[torch.Tensor, torch.Tensor]]]
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KV_TORCH_DTYPES = {**TORCH_DTYPES, "int8": torch.int8}  # protocol/kv_layout.py's cache dtypes


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInput:
    """A plan's arrays on the device, the same on every rank."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # rows of the batch whose next token is sampled: one a sequence, and 1 + drafts for a decode
    # with speculative drafts (its last token's row, then each draft's)
    logits_rows: torch.Tensor  # [R] int64


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's whole input as plain arrays, the same on every tensor-parallel rank: what rank 0
    sends its workers (engine/executor/executor.py), with no Sequence in it. ``arrays``: input_ids and
    positions [T], slots [T], tables [S, max_blocks], q_start [S+1], prefill_q_start, ends [S],
    logits_rows [R], and in a step with LoRA rows lora_slots [T] (each row's adapter slot,
    max_loras for a base-model row; host-side only, engine/lora/compute.py). ``prompt_rows``:
    (first row, rows) of each sequence due prompt logprobs."""

    arrays: dict[str, np.ndarray]
    num_decodes: int
    block_copies: list[tuple[int, int]]  # (source block, destination block), before the step
    prompt_rows: list[tuple[int, int]]

    def to_wire(self) -> dict:
        arrays = {k: (a.dtype.str, list(a.shape), a.tobytes()) for k, a in self.arrays.items()}
        return {
            "arrays": arrays,
            "num_decodes": self.num_decodes,
            "block_copies": self.block_copies,
            "prompt_rows": self.prompt_rows,
        }

    @classmethod
    def from_wire(cls, d: dict) -> StepPlan:
        arrays = {
            k: np.frombuffer(bytearray(b), np.dtype(t)).reshape(shape)
            for k, (t, shape, b) in d["arrays"].items()
        }
        copies = [(int(a), int(b)) for a, b in d["block_copies"]]
        rows = [(int(a), int(b)) for a, b in d["prompt_rows"]]
        return cls(arrays, int(d["num_decodes"]), copies, rows)


def check_quantization(quantization: str | None, platform: Platform) -> None:
    """ValueError naming why ``quantization`` cannot run on ``platform``; None where it can."""
    if quantization is None:
        return
    if not platform.packs_linears:
        raise ValueError(
            f"quantization {quantization} runs on the CPU only (oneDNN's int8 matmul), not on "
            f"{platform.device}"
        )
    why = cpu_int8.available()
    if why is not None:
        raise ValueError(f"quantization {quantization}: {why}")


def largest_prefill(num_tokens: int, num_seqs: int, max_model_len: int) -> list[int]:
    """The prompt lengths of the largest prefill step a scheduler can build under a budget of
    ``num_tokens`` tokens and ``num_seqs`` sequences, none longer than ``max_model_len``."""
    total = min(num_tokens, num_seqs * max_model_len)
    full, rest = divmod(total, max_model_len)
    return [max_model_len] * full + ([rest] if rest else [])


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        kv_spec: KVCacheSpec | None = None,
        kv_cache_factory: KVCacheFactory | None = None,
        platform: Platform | None = None,
        parallel: ParallelState = SINGLE,
    ) -> None:
        """Builds the model on the platform's device and loads its weights; the KV pool comes with
        ``kv_spec`` or later from ``allocate_kv`` (on a GPU, after ``profile`` has measured what the
        weights and a full step leave of the device's memory). ``parallel``: the tensor-parallel
        rank this runner is (its share of the weights and of the KV heads)."""
        self.model_config = model_config
        self.parallel = parallel
        self.num_kv_heads = len(kv_heads_of(model_config.num_kv_heads, parallel.tp_size, parallel.rank))
        self.platform = platform = platform or Platform()
        self.block_size = engine_config.block_size
        device = platform.device
        self.dtype = TORCH_DTYPES[
            resolve_dtype(engine_config.dtype, device.type, model_config.checkpoint_dtype)
        ]
        # the KV cache's: the model's, or int8 rows with their scales (kernels/kv_int8.py)
        self.kv_dtype = torch.int8 if engine_config.kv_cache_dtype == "int8" else self.dtype
        self.attention_backend = resolve_attention_backend(engine_config.attention_backend, device)
        max_positions = engine_config.max_model_len or model_config.max_position_embeddings
        # this rank's device before its weights (None on the CPU): ``profile`` measures from it
        self.device_start = device_start(platform)
        # every rank's measurement in the last ``profile``, in rank order (engine/machine/sizing.py)
        self.profiled: list[DeviceMemory] = []
        self.model = build_model(model_config, max_positions, self.dtype, device, parallel)
        load_weights(self.model, model_config.path)
        # every rank's adapter slots, zeroed; rank 0's engine decides what they hold (engine/lora)
        self.lora: LoRAModel | None = None
        if engine_config.enable_lora:
            limits = LoRALimits(engine_config.max_loras, engine_config.max_lora_rank)
            self.lora = LoRAModel(self.model, model_config, limits, self.dtype, device)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # oneDNN matmuls on weights packed once (kernels/cpu_linear.py), or int8 ones
        # (kernels/cpu_int8.py, --quantization int8); F.linear where neither can run
        self.quantization = engine_config.quantization
        packs = cpu_linear.enabled(self.dtype)
        self.packed_linear = (
            platform.packs_linears
            and (self.quantization is not None or packs)
            and cpu_linear.pack_linears(self.model, self.quantization, packs) > 0
        )
        # Called before each decoder layer runs: a node's liveness follows progress inside a step,
        # so a long step on a slow machine is told apart from a hung kernel (node/runtime.py).
        self.on_layer: Callable[[], None] | None = None
        for layer in decoder_layers(self.model, model_config.num_layers):
            layer.register_forward_pre_hook(self._layer_starts)
        self.inputs_buffer = StepInputs(platform)
        self.graphs: DecodeGraphs | None = None  # decode-only steps in CUDA graphs (use_decode_graphs)
        self.kv_spec: KVCacheSpec | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if kv_spec is not None:
            self.allocate_kv(kv_spec, kv_cache_factory)

    def allocate_kv(self, kv_spec: KVCacheSpec, kv_cache_factory: KVCacheFactory | None = None) -> None:
        """The KV pool. In host memory ``kv_cache_factory`` may place it (shared memory for the
        one-copy transfer); on a device it is one allocation, viewed per layer and K/V."""
        assert KV_TORCH_DTYPES[kv_spec.dtype] == self.kv_dtype, (kv_spec.dtype, self.kv_dtype)
        self.kv_spec = s = kv_spec
        self.block_size = s.block_size
        if self.platform.device.type != "cpu":
            shape = (s.num_layers, 2, s.num_blocks, *s.block_shape)
            pool = torch.zeros(shape, dtype=self.kv_dtype, device=self.platform.device)
            self.kv_caches = [(pool[i, 0], pool[i, 1]) for i in range(s.num_layers)]
        elif kv_cache_factory is not None:
            self.kv_caches = kv_cache_factory(kv_spec)
            assert len(self.kv_caches) == s.num_layers and self.kv_caches[0][0].dtype == self.kv_dtype
        else:
            self.kv_caches = [(self._empty_cache(s), self._empty_cache(s)) for _ in range(s.num_layers)]

    def _layer_starts(self, _module, _args) -> None:
        if self.on_layer is not None:
            self.on_layer()

    def _empty_cache(self, spec: KVCacheSpec) -> torch.Tensor:
        # numpy's zeros come from calloc: for a large pool the OS maps zero pages and commits each
        # page when a block is first written, so a pool sized from free memory costs only what is
        # used (torch.zeros would write every byte at start-up). bf16 rides as int16 bits.
        shape = (spec.num_blocks, *spec.block_shape)
        if self.kv_dtype == torch.bfloat16:
            return torch.from_numpy(np.zeros(shape, np.int16)).view(torch.bfloat16)
        numpy_dtype = {torch.int8: np.int8, torch.float16: np.float16}.get(self.kv_dtype, np.float32)
        return torch.from_numpy(np.zeros(shape, numpy_dtype))

    def profile(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        """``profile_steps`` under this rank's memory counters where its platform has a device:
        every rank measures its own process (engine/machine/sizing.py), and all of the ranks'
        measurements are gathered into ``profiled`` (a collective: every rank calls this)."""
        run = lambda: self.profile_steps(num_tokens, num_seqs, max_model_len)  # noqa: E731
        if self.device_start is None:
            run()
            return
        own = measure_device(self.platform, run, self.device_start, graphs=False)
        self.profiled = self._gather_memory(own)

    def _gather_memory(self, own: DeviceMemory) -> list[DeviceMemory]:
        """Every rank's ``own``, in rank order."""
        fields = [f.name for f in dataclasses.fields(DeviceMemory) if f.name != "graphs"]
        row = torch.tensor(
            [[getattr(own, f) for f in fields]], dtype=torch.int64, device=self.platform.device
        )
        rows = self.parallel.all_gather(row, dim=0)  # [tp, fields]
        return [DeviceMemory(**dict(zip(fields, r, strict=True))) for r in rows.tolist()]

    @torch.inference_mode()
    def profile_steps(self, num_tokens: int, num_seqs: int, max_model_len: int) -> None:
        """The largest steps this engine will run, on a throwaway one-block pool, so that the
        platform's peak memory counts their activations before the real pool is sized: a prefill
        step of ``num_tokens`` tokens, a decode of ``num_seqs`` rows whose block tables have the full
        width of ``max_model_len`` (the split-K partials of the decode kernel grow with it), and
        the logits and sampler work of ``num_seqs`` rows. Every slot points into block 0.

        No sequence is longer than the context, so the largest prefill step a scheduler can build
        is ``num_tokens`` tokens as prompts of at most ``max_model_len`` (and at most ``num_seqs``
        of them): one 2048-token prompt on a model of 512 positions would index past its rotary
        table (a device-side assert on CUDA, which poisons the context)."""
        dev = self.platform.device
        cache = self._scratch_cache()
        self._scratch_prefill(cache, largest_prefill(num_tokens, num_seqs, max_model_len))
        width = -(-max_model_len // self.block_size)
        decode = self._scratch_meta(
            num_seqs,
            num_seqs,
            torch.zeros((num_seqs, width), dtype=torch.int32, device=dev),
            torch.arange(num_seqs + 1, dtype=torch.int32, device=dev),
            torch.full((num_seqs,), max_model_len, dtype=torch.int32, device=dev),
        )
        positions = torch.full((num_seqs,), max_model_len - 1, dtype=torch.int64, device=dev)
        ids = torch.zeros(num_seqs, dtype=torch.int64, device=dev)
        hidden = self.model(ids, positions, cache, decode)
        torch.log_softmax(self.model.compute_logits(hidden), dim=-1)  # what the sampler holds
        self.platform.synchronize()

    @torch.inference_mode()
    def time_prefill(self, num_tokens: int) -> float:
        """Seconds of a prompt of ``num_tokens`` tokens through the model and its last row's
        logits, on ``profile``'s throwaway pool: the pool, blocks and caches of the engine are
        left as they were. A short pass first pays the first call's costs."""
        cache = self._scratch_cache()
        self._scratch_prefill(cache, [min(num_tokens, 16)])
        self.platform.synchronize()
        start = time.perf_counter()
        self._scratch_prefill(cache, [num_tokens])
        self.platform.synchronize()
        return time.perf_counter() - start

    def _scratch_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A one-block KV pool per layer, for passes whose KV nobody reads."""
        m, bs, dev = self.model_config, self.block_size, self.platform.device
        row = m.head_dim + (kv_int8.SCALE_BYTES if self.kv_dtype == torch.int8 else 0)
        shape = (1, bs, self.num_kv_heads, row)
        return [
            (
                torch.zeros(shape, dtype=self.kv_dtype, device=dev),
                torch.zeros(shape, dtype=self.kv_dtype, device=dev),
            )
            for _ in range(m.num_layers)
        ]

    def _scratch_prefill(self, cache, prompt_lens: list[int]) -> None:
        """Prompts of zeros, ``prompt_lens`` tokens each, through the model in one step on ``cache``
        (every slot in block 0), and each prompt's last row's logits."""
        dev, bs = self.platform.device, self.block_size
        lens = torch.tensor(prompt_lens, dtype=torch.int32, device=dev)
        q_start = torch.zeros(len(prompt_lens) + 1, dtype=torch.int32, device=dev)
        q_start[1:] = torch.cumsum(lens, 0)
        meta = self._scratch_meta(
            sum(prompt_lens),
            0,
            torch.zeros((len(prompt_lens), -(-max(prompt_lens) // bs)), dtype=torch.int32, device=dev),
            q_start,
            lens,
        )
        ids = torch.zeros(sum(prompt_lens), dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in prompt_lens])
        hidden = self.model(ids, positions, cache, meta)
        self.model.compute_logits(hidden[q_start[1:].long() - 1])

    def _scratch_meta(
        self, rows: int, num_decodes: int, tables: torch.Tensor, q_start: torch.Tensor, lens: torch.Tensor
    ) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.arange(rows, device=self.platform.device) % self.block_size,
            num_decode_tokens=num_decodes,
            decode_block_tables=tables[:num_decodes],
            decode_context_lens=lens[:num_decodes],
            prefill_block_tables=tables[num_decodes:],
            prefill_query_start_loc=q_start[num_decodes:] - q_start[num_decodes],
            prefill_context_lens=lens[num_decodes:],
            block_tables=tables,
            query_start_loc=q_start,
            context_lens=lens,
            backend=self.attention_backend,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepRun:
        """One step at this rank alone, every LM-head call made (benchmarks; an engine's steps go
        through its executor, which keeps the prompt slices for the engine to read)."""
        run = StepRun(self, self.plan(sched)[0])
        run.finish()
        return run

    def forward(self, plan: StepPlan, inp: ModelInput) -> torch.Tensor:
        """The plan's block copies, then the model over its rows: hidden states [T, hidden]."""
        for src, dst in plan.block_copies:
            for key_cache, value_cache in self.kv_caches:
                key_cache[dst] = key_cache[src]
                value_cache[dst] = value_cache[src]
        lora_slots = plan.arrays.get("lora_slots")
        if lora_slots is not None:  # never a graph: graphs hold no LoRA (engine/lora/model.py)
            assert self.lora is not None, "a plan with LoRA rows on a rank without LoRA slots"
            with self.lora.step(self.lora.batch(lora_slots)):
                return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        if self.graphs is not None and self._graphable(plan, inp, self.graphs):
            return self.graphs.run(inp.input_ids, inp.positions, inp.meta)
        return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)

    @staticmethod
    def _graphable(plan: StepPlan, inp: ModelInput, graphs: DecodeGraphs) -> bool:
        n = inp.input_ids.shape[0]
        return inp.meta.num_decode_tokens == n and not plan.prompt_rows and n <= graphs.sizes[-1]

    @property
    def has_host_routing(self) -> bool:
        """MoE layers route on the host (engine/layers/moe.py): never graph-captured."""
        return any(isinstance(m, moe.Experts) for m in self.model.modules())

    @torch.inference_mode()
    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Run decode-only steps in CUDA graphs from now on (``capture=False``: the same padded
        forward, eagerly, for tests on the CPU). After ``allocate_kv``: graphs keep its addresses."""
        assert self.kv_caches, "allocate the KV pool before capturing graphs over it"
        self.graphs = DecodeGraphs(self, max_num_seqs, max_model_len, capture)

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        """The batch's inputs on the device (``plan``, then ``inputs``)."""
        return self.inputs(self.plan(sched)[0])

    def plan(self, sched: SchedulerOutput) -> tuple[StepPlan, list[Sequence], list[Sequence]]:
        """The batch's flat inputs, built with numpy per sequence (no Python work per token), and
        the sequences of its logits rows and of its prompt rows, in order: rank 0's work before a
        step (the sequences stay with it; every rank gets the plan).

        Rows go in schedule order (decodes first, then prefill chunks); sequence i owns rows
        q_start[i]:q_start[i+1], positions computed[i] .. computed[i] + n_new[i] - 1.
        """
        assert self.kv_spec is not None, "allocate the KV pool before the first step"
        bs = self.kv_spec.block_size
        items = sched.scheduled
        n = len(items)
        computed = np.fromiter((it.seq.num_computed_tokens for it in items), np.int64, n)  # [S]
        num_new = np.fromiter((it.num_new_tokens for it in items), np.int64, n)  # [S]
        ends = computed + num_new  # [S] context lengths, new tokens included
        q_start = np.zeros(n + 1, np.int64)
        np.cumsum(num_new, out=q_start[1:])
        num_tokens = int(q_start[-1])
        row_seq = np.repeat(np.arange(n), num_new)  # [T] the sequence of every row
        positions = np.arange(num_tokens) - q_start[row_seq] + computed[row_seq]  # [T]
        tables = _pad_tables([it.seq.block_table for it in items])  # [S, max_blocks] int32
        slots = tables[row_seq, positions // bs].astype(np.int64) * bs + positions % bs  # [T]
        drafts = np.fromiter((len(it.seq.draft_token_ids) for it in items), np.int64, n)  # [S]
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                itertools.chain(it.seq.token_ids[c : c + k], it.seq.draft_token_ids)
                for it, c, k in zip(items, computed.tolist(), num_new.tolist(), strict=True)
            ),
            np.int64,
            num_tokens,
        )
        num_tokens_ahead = np.fromiter((it.seq.num_tokens for it in items), np.int64, n) + drafts
        sampled_mask = ends == num_tokens_ahead  # [S]
        per_seq = np.where(sampled_mask, 1 + drafts, 0)  # [S] logits rows of each sequence
        first_rows = np.repeat(q_start[1:] - per_seq, per_seq)  # [R]
        logits_rows = (
            first_rows + np.arange(len(first_rows)) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
        )
        num_decodes = int(np.count_nonzero(num_new == 1))
        assert num_new[:num_decodes].max(initial=1) == 1, "decode rows must come first"
        arrays = dict(
            input_ids=input_ids,
            positions=positions,
            slots=slots,
            tables=tables,
            q_start=q_start.astype(np.int32),
            prefill_q_start=(q_start[num_decodes:] - num_decodes).astype(np.int32),
            ends=ends.astype(np.int32),
            logits_rows=logits_rows,
        )
        lora_slots = self._lora_slots(items, num_new)
        if lora_slots is not None:
            arrays["lora_slots"] = lora_slots
        scored = _prompt_rows(items, computed, ends, q_start)
        plan = StepPlan(
            arrays,
            num_decodes,
            [(c.src_block_id, c.dst_block_id) for c in sched.block_copies],
            [(first, num) for _, first, num in scored],
        )
        sampled = [it.seq for it, due in zip(items, sampled_mask.tolist(), strict=True) if due]
        return plan, sampled, [seq for seq, _, _ in scored]

    def _lora_slots(self, items: list[ScheduledSeq], num_new: np.ndarray) -> np.ndarray | None:
        """[T] each row's adapter slot, every row of a sequence (prompt chunk, decode, drafts) its
        request's; None when no row has an adapter. Rank 0 only: the engine pinned each request's
        adapter in its slot from admission, so the slot stays put for the request's life."""
        if self.lora is None or not any(it.seq.params.adapter is not None for it in items):
            return None
        seq_slots = []
        for it in items:
            adapter = it.seq.params.adapter
            slot = None if adapter is None else self.lora.slot_of(adapter)
            assert adapter is None or slot is not None, (
                f"adapter {adapter!r} of a scheduled sequence has no slot"
            )
            seq_slots.append(slot)
        return token_slots_of(seq_slots, num_new.tolist(), self.lora.num_slots)

    def inputs(self, plan: StepPlan) -> ModelInput:
        """The plan's arrays on the device: one upload a step (lora_slots stay on the host: the
        LoRA batch groups rows from them there)."""
        uploaded = {k: a for k, a in plan.arrays.items() if k != "lora_slots"}
        on = self.inputs_buffer.upload(**uploaded)  # the device's copies: nothing reads the host arrays
        dec, pre = slice(0, plan.num_decodes), slice(plan.num_decodes, None)
        meta = AttentionMetadata(
            slot_mapping=on["slots"],
            num_decode_tokens=plan.num_decodes,
            decode_block_tables=on["tables"][dec],
            decode_context_lens=on["ends"][dec],
            prefill_block_tables=on["tables"][pre],
            prefill_query_start_loc=on["prefill_q_start"],
            prefill_context_lens=on["ends"][pre],
            block_tables=on["tables"],
            query_start_loc=on["q_start"],
            context_lens=on["ends"],
            backend=self.attention_backend,
        )
        return ModelInput(on["input_ids"], on["positions"], meta, on["logits_rows"])


PROMPT_LOGITS_ROWS = 256  # prompt rows per LM-head call: bounds a slice's logits [rows, vocab]


class StepRun:
    """One step on one tensor-parallel rank: the code every rank runs for a step, rank 0 in its
    executor and each worker in its process, on the same StepPlan. So the ranks make the same
    collectives in the same order by construction:

        forward pass           the layers' all-reduces, layer by layer
        sampled rows           one LM-head gather: ``logits`` [R, vocab]
        prompt rows            one LM-head gather per slice of PROMPT_LOGITS_ROWS rows, range by
                               range in ``plan.prompt_rows`` order (``prompt_logits``, ``finish``)

    What differs is only what a rank keeps. Rank 0 hands ``logits`` to its sampler and reads each
    range's slices as its engine scores that sequence's prompt (``prompt_logits``: one slice at a
    time, so a long prompt never holds all its logits at once); a worker drops them (``finish``
    at once). Rank 0 calls ``finish`` before its next call to the ranks, so a slice its engine
    did not read is still computed, and the workers' gathers are met."""

    @torch.inference_mode()
    def __init__(self, runner: ModelRunner, plan: StepPlan) -> None:
        inp = runner.inputs(plan)
        hidden = runner.forward(plan, inp)  # [T, hidden]
        assert hidden.shape[0] == inp.input_ids.shape[0], (hidden.shape, inp.input_ids.shape)
        self._model = runner.model
        self.logits = self._model.compute_logits(hidden[inp.logits_rows])  # [R, vocab] float32
        # per plan.prompt_rows range: its hidden rows [rows, hidden], each scored a slice at a time
        self.prompt_hidden = [hidden[first : first + num] for first, num in plan.prompt_rows]
        # every LM-head call of the prompt rows, in order: (range, its first row); range i's are
        # _slices[_range_bounds[i][0] : _range_bounds[i][1]]
        self._slices: list[tuple[int, int]] = []
        self._range_bounds: list[tuple[int, int]] = []
        for index, rows in enumerate(self.prompt_hidden):
            first = len(self._slices)
            self._slices += [(index, start) for start in range(0, rows.shape[0], PROMPT_LOGITS_ROWS)]
            self._range_bounds.append((first, len(self._slices)))
        self._num_done = 0  # of ``_slices``, made already

    def prompt_logits(self, hidden: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """The logits of ``hidden`` (one of ``prompt_hidden``, not read yet), a slice at a time:
        (first row, logits [rows, vocab]). Slices of earlier ranges not read yet are made first,
        and dropped."""
        index = next((i for i, rows in enumerate(self.prompt_hidden) if rows is hidden), None)
        assert index is not None, "not a prompt range of this step"
        first, end = self._range_bounds[index]
        assert self._num_done <= first, f"prompt range {index} was read already"
        while self._num_done < first:
            self._next_slice()
        while self._num_done < end:
            yield self._next_slice()

    def finish(self) -> None:
        """Make every LM-head call of the step not made yet, dropping the logits."""
        while self._num_done < len(self._slices):
            self._next_slice()

    @property
    def finished(self) -> bool:
        return self._num_done == len(self._slices)

    @torch.inference_mode()
    def _next_slice(self) -> tuple[int, torch.Tensor]:
        index, start = self._slices[self._num_done]
        self._num_done += 1
        rows = self.prompt_hidden[index][start : start + PROMPT_LOGITS_ROWS]  # [<= ROWS, hidden]
        return start, self._model.compute_logits(rows)


class StepInputs:
    """Each step's input arrays on the device: one host-to-device copy a step.

    On the CPU the "device" tensors are the numpy arrays themselves. Elsewhere the arrays are
    packed into one host buffer (pinned on CUDA), copied in one go into a device buffer of the
    same size and viewed from there; both buffers persist and grow only when a step outgrows
    them. A copy from pinned memory is asynchronous, so the next upload first waits for the
    event recorded after this one (normally long past: the sampler's sync a step follows it) before
    it writes the host buffer again.
    """

    ALIGN = 64  # bytes: every array starts aligned, so any dtype views the buffer

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self._host: torch.Tensor | None = None  # [capacity] uint8
        self._device: torch.Tensor | None = None  # [capacity] uint8
        self._copied = None  # the platform's event after the last copy

    def upload(self, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
        if not self.platform.separate_host:
            return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        offsets, end = {}, 0
        for name, a in arrays.items():
            offsets[name] = end
            end = -(-(end + a.nbytes) // self.ALIGN) * self.ALIGN
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the host buffer
        host, device = self._host, self._device
        if host is None or device is None or host.numel() < end:
            capacity = max(end, 2 * (0 if host is None else host.numel()), 1 << 16)
            host = self._host = self.platform.host_empty((capacity,), torch.uint8)
            device = self._device = torch.empty(capacity, dtype=torch.uint8, device=self.platform.device)
        staged = host.numpy()
        for name, a in arrays.items():
            staged[offsets[name] : offsets[name] + a.nbytes] = (
                np.ascontiguousarray(a).view(np.uint8).reshape(-1)
            )
        self.platform.copy(device[:end], host[:end])
        self._copied = copied = self.platform.event()
        copied.record()
        self.platform.uploaded(host[:end])
        out = {}
        for name, a in arrays.items():
            o = offsets[name]
            out[name] = device[o : o + a.nbytes].view(TORCH_OF_NUMPY[a.dtype]).view(a.shape)
        return out


TORCH_OF_NUMPY = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def _prompt_rows(items, computed: np.ndarray, ends: np.ndarray, q_start: np.ndarray) -> list:
    """ModelInput.prompt_rows: position p's logits score prompt token p + 1, so a sequence's
    rows run from its next unscored position to the prompt's last but one, within this chunk."""
    rows = []
    for i, item in enumerate(items):
        seq = item.seq
        if not seq.needs_prompt_logprobs:
            continue
        first, last = len(seq.prompt_logprobs), min(int(ends[i]), seq.num_prompt_tokens - 1)
        assert first >= computed[i], "prompt positions due logprobs were skipped (a prefix hit)"
        if first < last:
            rows.append((seq, int(q_start[i] + first - computed[i]), last - first))
    return rows


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: its first ModuleList of ``num_layers`` modules (HF's
    ``model.layers`` or GPT-2's ``transformer.h``; lists nested in a layer, such as MoE experts,
    come after it in ``modules()`` order)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"{type(model).__name__} has no ModuleList of its {num_layers} layers")


def _pad_tables(tables: list[list[int]]) -> np.ndarray:
    # -> [num_seqs, max_blocks] int32; padding points at block 0 and is masked by context lengths
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), width), np.int32)
    for row, table in zip(out, tables, strict=True):
        row[: len(table)] = table
    return out
