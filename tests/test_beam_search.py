"""Beam search in the engine (engine/sampling/beam_search.py) against Hugging Face's ``generate(num_beams=n)``
on the same weights: beams as forked sequences sharing blocks copy-on-write, beside ordinary
requests in the same steps, under preemption, and with the prompt prefilled on another engine."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_connector import KVTransfer
from pdserve.engine.core.requests import Aborted
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import ops
from pdserve.protocol.sampling_params import BeamSearch
from tests.engine_helpers import grant_remote, hf_beams, hf_eos_model, hf_greedy
from tests.tiny_models import make_tiny_model


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


def beams(n: int, max_tokens: int, length_penalty: float = 1.0, early_stopping: bool = False, **kw):
    search = BeamSearch(length_penalty=length_penalty, early_stopping=early_stopping)
    return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, beam_search=search, **kw)


def _with_eos(path: pathlib.Path, eos: int, tmp: pathlib.Path) -> str:
    """The same weights with ``eos`` as the end-of-sequence token."""
    dst = tmp / f"eos-{eos}"
    shutil.copytree(path, dst)
    for name in ("config.json", "generation_config.json"):
        file = dst / name
        if file.is_file():
            cfg = json.loads(file.read_text())
            cfg["eos_token_id"] = eos
            file.write_text(json.dumps(cfg))
    return str(dst)


def _tokens(out) -> list[list[int]]:
    return [o.token_ids for o in out.outputs]


CASES = [  # (n, max_tokens, length_penalty, early_stopping)
    (2, 8, 1.0, False),
    (3, 10, 0.0, True),
    (4, 7, 2.0, False),
    (3, 9, -0.5, False),
]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_beams_equal_hf_beside_ordinary_requests_in_one_batch(kind):
    path = str(make_tiny_model(kind))
    engine = LLM(path, num_kv_blocks=256, block_size=4, max_num_seqs=32)
    prompts = [_prompt(20 + i, n) for i, n in enumerate((5, 13, 30, 9))]
    params = [beams(*case, ignore_eos=True) for case in CASES]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = engine.generate([*prompts, prompts[0]], [*params, greedy])
    for prompt, p, out in zip(prompts, params, outs, strict=False):
        assert _tokens(out) == hf_beams(path, prompt, p, None), p
        assert [o.index for o in out.outputs] == list(range(p.n))
        assert all(o.finish_reason == "length" for o in out.outputs)
    assert outs[-1].outputs[0].token_ids == hf_greedy(path, prompts[0], 10)
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every beam's blocks came back


def test_beams_that_end_on_eos_finish_as_hf_finishes_them_with_their_logprobs(tmp_path):
    base = make_tiny_model("llama")
    prompt = _prompt(7, 11)
    # an EOS that some beams reach early: the third token of the second-best beam without one
    free = hf_beams(str(base), prompt, beams(3, 8), None)
    path = _with_eos(base, free[1][2], tmp_path)
    engine = LLM(path, num_kv_blocks=128, block_size=4)
    for early in (False, True):
        params = beams(3, 8, early_stopping=early, logprobs=2)
        (out,) = engine.generate([prompt], params)
        expected = hf_beams(path, prompt, params, free[1][2])
        assert _tokens(out) == expected
        assert any(o.finish_reason == "stop" for o in out.outputs)
        logits = hf_eos_model(path)(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0].detach()
        rows = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
        for pos, (token, lp) in enumerate(
            zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
        ):
            assert lp.token_id == token and abs(lp.logprob - float(rows[pos, token])) < 1e-4
            assert [t for t, _ in lp.top] == rows[pos].topk(2).indices.tolist()


def test_beams_stay_exact_through_preemption_in_a_small_pool():
    path = str(make_tiny_model("llama"))
    config = EngineConfig(model=path, num_kv_blocks=17, block_size=4, debug_checks=True)
    engine = LLMEngine(config)
    prompts = [_prompt(40 + i, 9 + 3 * i) for i in range(3)]
    params = beams(3, 12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    preempted: list = []
    preempt = engine.scheduler._preempt  # counted on the way through
    engine.scheduler._preempt = lambda seq: (preempted.append(seq), preempt(seq))  # type: ignore[method-assign]
    results = {}
    while engine.has_work():
        for out in engine.step().outputs:
            results[out.request_id] = _tokens(out)
    assert any(s.params.beam_search for s in preempted)  # the pool is too small for all nine beams
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"] == hf_beams(path, prompt, params, None)
    assert engine.block_manager.num_free_blocks == 17


def test_a_prompt_prefilled_elsewhere_forks_its_beams_on_the_decode_engine():
    path = str(make_tiny_model("qwen2"))
    prefill = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8))
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=8))
    prompt = _prompt(3, 21)
    params = beams(3, 9, length_penalty=0.5, ignore_eos=True, logprobs=1)
    prefill.add_request("a", prompt, params, kv_transfer=KVTransfer.SEND)
    step = prefill.step()
    (out,) = step.outputs
    first = out.outputs[0]
    assert [h.request_id for h in step.kv.held] == ["a"]  # it goes on on the decode engine
    assert len(first.logprobs[0].top) >= 6  # every candidate of the first step
    held = prefill.scheduler.held["a"]
    reservation, _ = grant_remote(decode, "a", prompt, params)
    buf = ops.gather_blocks(
        [k for k, _ in prefill.runner.kv_caches],
        [v for _, v in prefill.runner.kv_caches],
        torch.tensor(held.block_table[reservation.num_held_blocks :]),
    )
    ops.scatter_blocks(
        buf,
        [k for k, _ in decode.runner.kv_caches],
        [v for _, v in decode.runner.kv_caches],
        torch.tensor(reservation.block_ids),
    )
    decode.kv_connector.kv_arrived("a", first.token_ids[0], first.logprobs[0])
    assert prefill.abort_request("a") is Aborted.KV_OUTBOUND
    outs = []
    while decode.has_work():
        outs += decode.step().outputs
    (out,) = outs
    assert _tokens(out) == hf_beams(path, prompt, params, None)
    assert all(len(o.logprobs) == len(o.token_ids) for o in out.outputs)
    assert decode.block_manager.num_free_blocks == 64


def test_an_aborted_beam_search_gives_back_every_block():
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=4, debug_checks=True))
    engine.add_request("a", _prompt(1, 10), beams(4, 20, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert len(engine.requests["a"].seqs) == 4 and engine.block_manager.num_free_blocks < 64
    engine.abort_request("a")
    assert engine.block_manager.num_free_blocks == 64 and not engine.has_work()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"top_k": 5}, "top_k"),
        ({"stop": ("x",)}, "stop"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"temperature": 0.7}, "temperature"),
        ({"min_tokens": 2}, "min_tokens"),
    ],
)
def test_fields_beam_search_cannot_honour_are_refused_by_name(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(beams(2, 4), **change)


def test_more_beams_than_the_engine_holds_at_once_are_refused():
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=4, max_num_seqs=4))
    with pytest.raises(ValueError, match="n: 5 beams exceed"):
        engine.add_request("a", [5, 6, 7], beams(5, 4))
    with pytest.raises(ValueError, match="KV blocks at once"):
        engine.add_request("b", [5, 6, 7], beams(4, 20))
    engine.add_request("c", [5, 6, 7], beams(2, 8))
    assert list(engine.requests) == ["c"] and engine.requests["c"].seqs[0].max_tokens == 8
