"""The engine with ``attention_backend="triton"``: every attention call and KV write of the
serving path goes through the Triton kernels, here in Triton's interpreter on CPU tensors.
Greedy output equals Hugging Face on each case. Run by tests/test_engine_triton_backend.py in a
child process with TRITON_INTERPRET=1 (it must be set before triton is first imported)."""

from __future__ import annotations

import collections
import os

import pytest

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import kv_write, paged_decode, paged_prefill
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/test_engine_triton_backend.py"
CALLS: collections.Counter[str] = collections.Counter()


@pytest.fixture(autouse=True)
def count_kernel_calls(monkeypatch):
    """Count the Triton entry points the engine reaches (they are looked up at each call)."""
    CALLS.clear()
    for module, name in (
        (kv_write, "write_kv_cache_triton"),
        (paged_decode, "paged_decode_attention_triton"),
        (paged_prefill, "paged_prefill_attention_triton"),
    ):
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            CALLS[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def _engine(kind: str = "llama", **config) -> LLMEngine:
    defaults = dict(num_kv_blocks=64, block_size=8, attention_backend="triton")
    return LLMEngine(EngineConfig(model=str(make_tiny_model(kind)), **{**defaults, **config}))


def _run(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_work():
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def _check(engine: LLMEngine, prompts: dict[str, list[int]], max_tokens: int) -> None:
    got = _run(engine, prompts, max_tokens)
    for rid, prompt in prompts.items():
        assert got[rid] == hf_greedy(engine.config.model, prompt, max_tokens), rid
    assert CALLS["write_kv_cache_triton"] and CALLS["paged_prefill_attention_triton"]
    assert CALLS["paged_decode_attention_triton"]


def test_a_plain_batch_of_mixed_lengths_decodes_together():
    _check(_engine(), {"a": list(range(3, 8)), "b": list(range(20, 37)), "c": list(range(50, 80))}, 6)


def test_chunked_prefill():
    engine = _engine(max_num_batched_tokens=16)
    _check(engine, {"long": list(range(3, 46)), "short": [9, 8, 7]}, 5)


def test_a_prefix_hit():
    engine = _engine()
    shared = list(range(100, 124))  # three full blocks
    _check(engine, {"first": [*shared, 5, 6]}, 4)
    _check(engine, {"second": [*shared, 7, 8, 9]}, 4)
    assert engine.block_manager.num_cached_free_blocks >= 3


def test_a_preemption():
    engine = _engine(num_kv_blocks=10, block_size=4)
    prompts = {f"p{i}": list(range(10 + 7 * i, 22 + 7 * i)) for i in range(3)}  # 3 blocks each, 10 in all
    preempted = []
    real_preempt = engine.scheduler._preempt

    def preempt(seq):
        preempted.append(seq.request_id)
        real_preempt(seq)

    engine.scheduler._preempt = preempt
    _check(engine, prompts, 12)
    assert preempted, "the pool was meant to run out"


def test_a_sliding_window_model():
    _check(_engine("mistral"), {"a": list(range(3, 43)), "b": list(range(60, 70))}, 6)


def test_padded_decode_batches_on_the_split_platform(monkeypatch):
    """What a CUDA graph runs, eagerly: decode batches padded to a capture size (rows of slot -1
    and context 0), the device buffers apart from the poisoned host ones. Padding changes no row."""
    monkeypatch.setenv("PDSERVE_TEST_PLATFORM", "split")
    engine = _engine(max_num_seqs=6, max_model_len=96)
    assert engine.platform.kind == "split"
    engine.runner.use_decode_graphs(engine.config.max_num_seqs, engine.max_model_len, capture=False)
    padded = collections.Counter()
    real_run = engine.runner.graphs.run

    def run(input_ids, positions, meta):
        padded[engine.runner.graphs.padded_size(input_ids.shape[0]) - input_ids.shape[0]] += 1
        return real_run(input_ids, positions, meta)

    engine.runner.graphs.run = run
    _check(engine, {"a": list(range(3, 8)), "b": list(range(20, 37)), "c": list(range(50, 80))}, 6)
    assert padded[1] > 0, padded  # three rows ran as a batch of four
