"""Owns the model weights and the paged KV cache; turns a SchedulerOutput into logits."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.device import resolve_attention_backend, resolve_dtype
from engine.kv_layout import KVCacheSpec
from engine.models import model_class
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.weights import load_weights

KVCacheFactory = Callable[[KVCacheSpec], list[tuple[torch.Tensor, torch.Tensor]]]
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [S] rows of the batch whose next token is sampled
    sampled_seqs: list[Sequence]  # the sequences those rows belong to, same order


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
        if kv_cache_factory is not None:
            self.kv_caches = kv_cache_factory(kv_spec)
            assert len(self.kv_caches) == kv_spec.num_layers and self.kv_caches[0][0].dtype == self.dtype
        else:
            self.kv_caches = [(self._empty_cache(), self._empty_cache()) for _ in range(kv_spec.num_layers)]

    def _empty_cache(self) -> torch.Tensor:
        s = self.kv_spec
        return torch.zeros(s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=self.dtype)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one forward pass; returns logits [S, vocab] of the sequences due a new token."""
        for copy in sched.block_copies:
            for key_cache, value_cache in self.kv_caches:
                key_cache[copy.dst_block_id] = key_cache[copy.src_block_id]
                value_cache[copy.dst_block_id] = value_cache[copy.src_block_id]
        inp = self.prepare(sched)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        return self.model.compute_logits(hidden[inp.logits_rows]), inp.sampled_seqs

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.kv_spec.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Sequence] = []
        decode_tables, decode_lens, prefill_tables, prefill_lens, q_starts = [], [], [], [], [0]
        num_decodes = 0
        for item in sched.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            if item.num_new_tokens == 1:
                num_decodes += 1
                decode_tables.append(table)
                decode_lens.append(end)
            else:
                prefill_tables.append(table)
                prefill_lens.append(end)
                q_starts.append(q_starts[-1] + item.num_new_tokens)
            if end == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode_tokens=num_decodes,
            decode_block_tables=_pad_tables(decode_tables),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32),
            prefill_block_tables=_pad_tables(prefill_tables),
            prefill_query_start_loc=torch.tensor(q_starts, dtype=torch.int32),
            prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32),
            backend=self.attention_backend,
        )
        return ModelInput(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            meta,
            torch.tensor(logits_rows, dtype=torch.int64),
            sampled,
        )


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    # -> [num_seqs, max_blocks] int32; padding points at block 0 and is masked by context_lens
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).reshape(
        len(tables), width
    )
