"""Owns the model weights and the paged KV cache; turns a SchedulerOutput into logits."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.device import resolve_attention_backend, resolve_dtype
from engine.kv_layout import KVCacheSpec
from engine.models import model_class
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.weights import load_weights
from kernels import cpu_linear

KVCacheFactory = Callable[[KVCacheSpec], list[tuple[torch.Tensor, torch.Tensor]]]
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [S] rows of the batch whose next token is sampled
    sampled_seqs: list[Sequence]  # the sequences those rows belong to, same order
    # Sequences due prompt logprobs: (sequence, first row, rows), the rows of prompt positions
    # len(seq.prompt_logprobs) onwards that this step computes (each predicts the next prompt token)
    prompt_rows: list[tuple[Sequence, int, int]] = dataclasses.field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        kv_spec: KVCacheSpec,
        kv_cache_factory: KVCacheFactory | None = None,
    ) -> None:
        """kv_cache_factory: allocates the per-layer (K, V) caches for ``kv_spec`` (e.g. in shared
        memory, for the one-copy transfer); plain zeroed tensors by default."""
        self.model_config = model_config
        self.kv_spec = kv_spec
        device = torch.device("cpu")  # engine.device: the only one the runner builds tensors on yet
        self.dtype = TORCH_DTYPES[resolve_dtype(engine_config.dtype, device)]
        self.attention_backend = resolve_attention_backend(engine_config.attention_backend, device)
        max_positions = engine_config.max_model_len or model_config.max_position_embeddings
        self.model = model_class(model_config)(model_config, max_positions).to(self.dtype).eval()
        load_weights(self.model, model_config.path)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # oneDNN matmuls on weights packed once (kernels/cpu_linear.py); F.linear where it can't
        self.packed_linear = cpu_linear.enabled(self.dtype) and cpu_linear.pack_linears(self.model) > 0
        # Called before each decoder layer runs: a node's liveness follows progress inside a step,
        # so a long step on a slow machine is told apart from a hung kernel (node/runtime.py).
        self.on_layer: Callable[[], None] | None = None
        for layer in decoder_layers(self.model, model_config.num_layers):
            layer.register_forward_pre_hook(self._layer_starts)
        if kv_cache_factory is not None:
            self.kv_caches = kv_cache_factory(kv_spec)
            assert len(self.kv_caches) == kv_spec.num_layers and self.kv_caches[0][0].dtype == self.dtype
        else:
            self.kv_caches = [(self._empty_cache(), self._empty_cache()) for _ in range(kv_spec.num_layers)]

    def _layer_starts(self, _module, _args) -> None:
        if self.on_layer is not None:
            self.on_layer()

    def _empty_cache(self) -> torch.Tensor:
        # numpy's zeros come from calloc: for a large pool the OS maps zero pages and commits each
        # page when a block is first written, so a pool sized from free memory costs only what is
        # used (torch.zeros would write every byte at start-up). bf16 rides as int16 bits.
        s = self.kv_spec
        shape = (s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        if self.dtype == torch.bfloat16:
            return torch.from_numpy(np.zeros(shape, np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.zeros(shape, np.float16 if self.dtype == torch.float16 else np.float32))

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, list[Sequence], list[tuple[Sequence, torch.Tensor]]]:
        """Run one forward pass; returns logits [S, vocab] of the sequences due a new token, and
        the hidden states [rows, hidden] of the prompt positions due prompt logprobs, by sequence
        (``prompt_logits`` turns them into logits a slice at a time)."""
        for copy in sched.block_copies:
            for key_cache, value_cache in self.kv_caches:
                key_cache[copy.dst_block_id] = key_cache[copy.src_block_id]
                value_cache[copy.dst_block_id] = value_cache[copy.src_block_id]
        inp = self.prepare(sched)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        prompt_hidden = [(seq, hidden[first : first + num]) for seq, first, num in inp.prompt_rows]
        return self.model.compute_logits(hidden[inp.logits_rows]), inp.sampled_seqs, prompt_hidden

    @torch.inference_mode()
    def prompt_logits(self, hidden: torch.Tensor, max_rows: int = 256):
        """Logits of ``hidden``'s rows, ``max_rows`` at a time: (first row, logits [rows, vocab])."""
        for start in range(0, hidden.shape[0], max_rows):
            yield start, self.model.compute_logits(hidden[start : start + max_rows])

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        """The batch's flat inputs, built with numpy per sequence (no Python work per token).

        Rows go in schedule order (decodes first, then prefill chunks); sequence i owns rows
        q_start[i]:q_start[i+1], positions computed[i] .. computed[i] + n_new[i] - 1.
        """
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
        input_ids = np.fromiter(
            itertools.chain.from_iterable(
                it.seq.token_ids[c : c + k]
                for it, c, k in zip(items, computed.tolist(), num_new.tolist(), strict=True)
            ),
            np.int64,
            num_tokens,
        )
        sampled_mask = ends == np.fromiter((it.seq.num_tokens for it in items), np.int64, n)  # [S]
        num_decodes = int(np.count_nonzero(num_new == 1))
        assert num_new[:num_decodes].max(initial=1) == 1, "decode rows must come first"
        dec, pre = slice(0, num_decodes), slice(num_decodes, n)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots),
            num_decode_tokens=num_decodes,
            decode_block_tables=torch.from_numpy(tables[dec]),
            decode_context_lens=torch.from_numpy(ends[dec].astype(np.int32)),
            prefill_block_tables=torch.from_numpy(tables[pre]),
            prefill_query_start_loc=torch.from_numpy((q_start[num_decodes:] - num_decodes).astype(np.int32)),
            prefill_context_lens=torch.from_numpy(ends[pre].astype(np.int32)),
            block_tables=torch.from_numpy(tables),
            query_start_loc=torch.from_numpy(q_start.astype(np.int32)),
            context_lens=torch.from_numpy(ends.astype(np.int32)),
            backend=self.attention_backend,
        )
        return ModelInput(
            torch.from_numpy(input_ids),
            torch.from_numpy(positions),
            meta,
            torch.from_numpy(q_start[1:][sampled_mask] - 1),
            [it.seq for it, due in zip(items, sampled_mask.tolist(), strict=True) if due],
            _prompt_rows(items, computed, ends, q_start),
        )


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
