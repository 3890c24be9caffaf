"""The model runner's flat inputs for a mixed batch (numpy-built): exact rows, positions and slots."""

from __future__ import annotations

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.executor.model_runner import ModelRunner
from pdserve.protocol.kv_layout import KVCacheSpec
from tests.tiny_models import make_tiny_model


def _seq(name: str, tokens: list[int], computed: int, table: list[int]) -> Sequence:
    seq = Sequence(name, tokens, len(tokens), SamplingParams())
    seq.num_computed_tokens, seq.block_table = computed, table
    return seq


def test_prepare_lays_out_a_decode_and_a_chunk_after_a_cached_prefix():
    path = make_tiny_model("llama")
    cfg = ModelConfig.from_path(path)
    spec = KVCacheSpec(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, "float32")
    runner = ModelRunner(
        cfg, EngineConfig(model=str(path), dtype="float32", block_size=4, num_kv_blocks=8), spec
    )
    decode = _seq("d", [5, 6, 7, 8, 9, 10], computed=5, table=[6, 1])  # one new token at position 5
    chunk = _seq("p", list(range(20, 31)), computed=4, table=[3, 0, 7])  # positions 4..8 of 11 tokens
    plan, sampled, scored = runner.plan(
        SchedulerOutput([ScheduledSeq(decode, 1), ScheduledSeq(chunk, 5)], [], [])
    )
    inp = runner.inputs(plan)
    assert inp.input_ids.tolist() == [10, 24, 25, 26, 27, 28]
    assert inp.positions.tolist() == [5, 4, 5, 6, 7, 8]
    # slot = block * 4 + offset: decode pos 5 -> block 1; chunk pos 4..7 -> block 0, pos 8 -> block 7
    assert inp.meta.slot_mapping.tolist() == [5, 0, 1, 2, 3, 28]
    assert inp.meta.num_decode_tokens == 1
    assert inp.meta.query_start_loc.tolist() == [0, 1, 6]
    assert inp.meta.context_lens.tolist() == [6, 9]
    assert inp.meta.block_tables.tolist() == [[6, 1, 0], [3, 0, 7]]
    assert inp.meta.prefill_query_start_loc.tolist() == [0, 5]
    assert inp.meta.decode_context_lens.tolist() == [6]
    # only the decode reaches its last token: the chunk's sequence still has tokens to compute
    assert inp.logits_rows.tolist() == [0] and sampled == [decode] and scored == []
