"""Prefill-only requests hand their KV to another engine, which decodes on: exact against HF."""

from __future__ import annotations

import torch

import kernels
from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import Sequence
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model


def _move_kv(src: LLMEngine, dst: LLMEngine, seq: Sequence, request_id: str) -> Sequence:
    """What kv_transfer does over the wire, done in-process: gather, reserve, scatter."""
    prompt = seq.token_ids[:seq.num_prompt_tokens]
    moved = Sequence(request_id, list(prompt), len(prompt), seq.params)
    dst.block_manager.append(moved, len(prompt))
    src_k = [k for k, _ in src.runner.kv_caches]
    src_v = [v for _, v in src.runner.kv_caches]
    buf = kernels.gather_blocks(src_k, src_v, torch.tensor(seq.block_table))
    kernels.scatter_blocks(buf, [k for k, _ in dst.runner.kv_caches], [v for _, v in dst.runner.kv_caches],
                           torch.tensor(moved.block_table))
    moved.num_computed_tokens = len(prompt)
    dst.block_manager.commit_computed(moved)
    moved.token_ids.append(seq.token_ids[-1])
    return moved


def test_prefill_only_then_decode_elsewhere_matches_hf():
    path = str(make_tiny_model("qwen2"))
    prefill = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8))
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=40, block_size=8))
    decode.block_manager.free_block_ids.move_to_end(0)  # different free layout on the receiver
    prompts = {"a": list(range(3, 40)), "b": list(range(50, 61))}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt, params, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    assert set(prefill.held) == {"a", "b"}
    for rid in prompts:
        decode.add_prefilled(_move_kv(prefill, decode, prefill.held[rid], rid))
        assert prefill.release_held(rid)
    assert prefill.block_manager.num_free_blocks == 32
    results = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    for rid, prompt in prompts.items():
        assert results[rid] == hf_greedy(path, prompt, 12)
    assert decode.block_manager.num_free_blocks == 40


def test_first_token_that_ends_the_request_finishes_at_adoption():
    path = str(make_tiny_model("llama"))
    prefill = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=8))
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=8))
    prefill.add_request("x", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1), prefill_only=True)
    prefill.step()
    outs = decode.add_prefilled(_move_kv(prefill, decode, prefill.held["x"], "x"))
    assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "length"
    assert decode.block_manager.num_free_blocks == 16
    prefill.abort_request("x")  # abort releases held blocks too
    assert prefill.block_manager.num_free_blocks == 16
