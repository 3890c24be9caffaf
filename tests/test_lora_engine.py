"""LoRA adapters served by the engine (LLM, LLMEngine), exact against PEFT's PeftModel: a
concurrent batch of base rows and three seeded adapters (ranks 4, 8, 16; different targets) with
a chunked prompt and max_loras=2, so that one adapter waits for a slot, evicts another, and the
evicted one is read again on demand; preemption by a tiny pool; a seeded n > 1 request; beam
search; n-gram drafts; a prompt prefilled on one engine and decoded on another; tp=2. Greedy
tokens equal PeftModel's and their logprobs are within 1e-4. Requests pin their adapter until
they end, wait (not fail) while every slot is pinned, never take the decode graphs, and what
cannot be served is refused naming the field."""

from __future__ import annotations

import dataclasses
import functools
import shutil

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_connector import KVTransfer
from pdserve.engine.core.requests import QueueFullError
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora.registry import UnknownAdapterError
from pdserve.protocol.sampling_params import BeamSearch
from tests.engine_helpers import greedy_with_logprobs, hf_model
from tests.test_engine_disagg import _move_kv
from tests.test_lora_model import _adapters, _peft_model, _prompt
from tests.tiny_models import make_tiny_model

ATOL = 1e-4
NAMES = ("attn", "mlp", "all")  # tests/test_lora_model.py's ADAPTERS: r 4, 8 (rsLoRA) and 16
# The batch: (adapter or None for the base model, prompt length, max_tokens). With a 16-token
# budget the 30-token prompt runs in chunks; with two slots "all" waits for one until an
# earlier adapter's requests end.
ROWS = [(None, 7, 6), ("attn", 30, 5), ("mlp", 5, 9), ("all", 11, 6), ("attn", 9, 4), (None, 12, 8)]


def _modules(kind: str, names=NAMES) -> tuple[tuple[str, str], ...]:
    folders = _adapters(kind)
    return tuple((name, folders[name]) for name in names)


def _llm(kind: str, **kw) -> LLM:
    options = dict(enable_lora=True, max_loras=2, lora_modules=_modules(kind), num_kv_blocks=64, block_size=4)
    return LLM(str(make_tiny_model(kind)), **{**options, **kw})


@functools.cache
def _oracle(kind: str, adapter: str | None, prompt: tuple[int, ...], max_tokens: int):
    """PeftModel's greedy tokens (the plain HF model's for None), EOS ignored, and each one's
    logprob: one full forward per token."""
    base = str(make_tiny_model(kind))
    model = hf_model(base) if adapter is None else _peft_model(base, _adapters(kind)[adapter])
    return greedy_with_logprobs(model, prompt, max_tokens)


def _greedy(adapter: str | None, max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, adapter=adapter
    )


def _assert_exact(kind: str, rows, outputs) -> None:
    for (adapter, prompt, max_tokens), out in zip(rows, outputs, strict=True):
        want_tokens, want_logprobs = _oracle(kind, adapter, tuple(prompt), max_tokens)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, (adapter, len(prompt))
        assert [e.logprob for e in got.logprobs] == pytest.approx(want_logprobs, abs=ATOL), adapter


def _rows(rows=ROWS) -> list[tuple[str | None, list[int], int]]:
    return [(adapter, _prompt(i, n), max_tokens) for i, (adapter, n, max_tokens) in enumerate(rows)]


def _stats(engine: LLMEngine) -> dict:
    return {s.name: s for s in engine.stats().adapters}


def _names(engine: LLMEngine) -> tuple[str, ...]:
    """The adapters the engine serves, in the order they came."""
    return tuple(_stats(engine))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_mixed_batch_of_three_adapters_and_base_rows_in_two_slots_matches_peft(kind):
    llm = _llm(kind, max_num_batched_tokens=16, debug_checks=True)
    engine = llm.engine
    assert _names(engine) == NAMES
    assert {n: s.slot for n, s in _stats(engine).items()} == {"attn": 0, "mlp": 1, "all": None}
    rows = _rows()
    _assert_exact(kind, rows, llm.generate([p for _, p, _ in rows], [_greedy(a, m) for a, _, m in rows]))
    for adapter, prompt, max_tokens in rows:  # each adapter moves its row off the base model's
        if adapter is not None:
            base_logprobs = _oracle(kind, None, tuple(prompt), max_tokens)[1]
            peft_logprobs = _oracle(kind, adapter, tuple(prompt), max_tokens)[1]
            assert max(abs(a - b) for a, b in zip(base_logprobs, peft_logprobs, strict=True)) > 1e-2
    stats = _stats(engine)
    assert stats["all"].num_loads == 1 and stats["all"].num_requests == 1  # loaded on demand
    assert sum(s.num_evictions for s in stats.values()) == 1  # ... into an LRU slot no request pinned
    evicted = next(s.name for s in stats.values() if s.num_evictions)
    assert stats[evicted].slot is None and all(s.num_running_requests == 0 for s in stats.values())
    again = _rows([(evicted, 6, 5), ("all", 8, 3)])  # the evicted one is read again from its folder
    _assert_exact(kind, again, llm.generate([p for _, p, _ in again], [_greedy(a, m) for a, _, m in again]))
    assert _stats(engine)[evicted].num_loads == 2
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_request_waits_for_a_slot_while_every_slot_is_pinned():
    llm = _llm("llama", max_loras=1, lora_modules=_modules("llama", ("attn", "mlp")), max_waiting=2)
    engine = llm.engine
    rows = _rows([("attn", 6, 6), ("mlp", 7, 3), (None, 5, 3)])
    for i, (adapter, prompt, max_tokens) in enumerate(rows[:2]):
        engine.add_request(str(i), prompt, _greedy(adapter, max_tokens))
    engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ["1"]  # "attn" holds the one slot
    assert _stats(engine)["mlp"].num_waiting_requests == 1
    assert engine.stats().num_waiting == 1 and engine.has_work()
    engine.add_request("x", [5, 6, 7], _greedy("mlp", 2))  # behind "1", then aborted: gone
    engine.abort_request("x")
    assert [s.request_id for s in engine.scheduler.waiting] == ["1"]
    engine.add_request("2", rows[2][1], _greedy(None, rows[2][2]))  # a base row passes it
    with pytest.raises(QueueFullError):  # the slot's waiters count against max_waiting too
        engine.add_request("3", [5, 6, 7], _greedy(None, 2))
    with pytest.raises(ValueError, match="'mlp' is in use by 1 requests"):
        engine.unload_adapter("mlp")  # waiting for a slot is using it
    engine.step()
    assert {s.request_id for s in engine.scheduler.running} == {"0", "2"}
    finished = {}
    while engine.has_work():
        finished.update({o.request_id: o for o in engine.step().outputs if o.finished})
    _assert_exact("llama", rows, [finished[str(i)] for i in range(3)])
    assert _stats(engine)["attn"].num_evictions == 1 and _stats(engine)["mlp"].num_loads == 1


def test_a_waiting_request_whose_adapter_folder_vanished_ends_aborted(tmp_path):
    folder = tmp_path / "mlp"
    shutil.copytree(_adapters("llama")["mlp"], folder)
    modules = (("attn", _adapters("llama")["attn"]), ("mlp", str(folder)))
    engine = _llm("llama", max_loras=1, lora_modules=modules).engine
    engine.add_request("a", [5, 6, 7], _greedy("attn", 3))
    engine.add_request("m", [5, 6, 7], _greedy("mlp", 3))  # waits: "attn" pins the one slot
    shutil.rmtree(folder)
    outputs = {}
    while engine.has_work():
        outputs.update({o.request_id: o for o in engine.step().outputs if o.finished})
    assert outputs["m"].outputs[0].finish_reason == "abort" and outputs["m"].outputs[0].token_ids == []
    assert len(outputs["a"].outputs[0].token_ids) == 3
    engine.scheduler.check_integrity()


def test_preemption_by_a_tiny_pool_keeps_adapter_rows_exact():
    llm = _llm("llama", max_loras=3, num_kv_blocks=14)  # 56 slots for six of up to 44 tokens
    engine = llm.engine
    rows = _rows([(NAMES[i % 3] if i % 4 else None, 10 + 2 * i, 24) for i in range(6)])
    for i, (adapter, prompt, max_tokens) in enumerate(rows):
        engine.add_request(str(i), prompt, _greedy(adapter, max_tokens))
    finished, preemptions = {}, 0
    while engine.has_work():
        preemptions += sum(1 for s in engine.scheduler.waiting if s.num_preemptions)
        finished.update({o.request_id: o for o in engine.step().outputs if o.finished})
    assert preemptions > 0
    _assert_exact("llama", rows, [finished[str(i)] for i in range(len(rows))])


def test_a_seeded_n_gt_1_request_with_an_adapter_repeats_and_its_logprobs_are_peft_s():
    params = SamplingParams(
        temperature=0.9, top_p=0.9, n=3, seed=7, max_tokens=8, ignore_eos=True, logprobs=0, adapter="mlp"
    )
    prompt = _prompt(3, 10)
    first = _llm("llama").generate([prompt], params)[0]
    again = _llm("llama").generate([prompt, prompt], params)  # a second engine, twice in one batch
    samples = [o.token_ids for o in first.outputs]
    assert len(set(map(tuple, samples))) > 1  # n different samples, each with the adapter's logprobs
    assert all([o.token_ids for o in out.outputs] == samples for out in again)
    model = _peft_model(str(make_tiny_model("llama")), _adapters("llama")["mlp"])
    for out in first.outputs:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])
        assert [e.logprob for e in out.logprobs] == pytest.approx(want[:, 0].tolist(), abs=ATOL)


def test_ngram_drafts_of_an_adapter_row_are_verified_with_its_adapter():
    llm = _llm("llama", speculative="ngram", num_speculative_tokens=3)
    rows = [("all", [5, 6, 7, 8, 9] * 6, 12), (None, [5, 6, 7, 8, 9] * 5, 12)]
    _assert_exact("llama", rows[:1], llm.generate([rows[0][1]], _greedy("all", 12)))
    assert llm.engine.speculator.stats.accepted_tokens > 0  # its output repeats: drafts verified
    _assert_exact("llama", rows, llm.generate([p for _, p, _ in rows], [_greedy(a, m) for a, _, m in rows]))


def test_beam_search_with_an_adapter_equals_peft_s_beams():
    kind, n, max_tokens = "llama", 3, 6
    search = BeamSearch(length_penalty=1.0, early_stopping=False)
    params = SamplingParams(
        n=n, temperature=0.0, max_tokens=max_tokens, beam_search=search, ignore_eos=True, adapter="all"
    )
    rows = _rows([("all", 9, max_tokens), (None, 7, 5)])
    beams, greedy = _llm(kind).generate([p for _, p, _ in rows], [params, _greedy(None, 5)])
    model = _peft_model(str(make_tiny_model(kind)), _adapters(kind)["all"])
    with torch.no_grad():
        want = model.generate(
            input_ids=torch.tensor([rows[0][1]]),
            num_beams=n,
            num_return_sequences=n,
            max_new_tokens=max_tokens,
            length_penalty=1.0,
            early_stopping=False,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[:, len(rows[0][1]) :].tolist()
    assert [o.token_ids for o in beams.outputs] == want
    _assert_exact(kind, rows[1:], [greedy])


def test_a_prompt_prefilled_with_an_adapter_decodes_elsewhere_with_it_exactly():
    base = str(make_tiny_model("qwen2"))
    options = dict(model=base, enable_lora=True, max_loras=2, block_size=8, lora_modules=_modules("qwen2"))
    prefill = LLMEngine(EngineConfig(**options, num_kv_blocks=32))
    decode = LLMEngine(EngineConfig(**options, num_kv_blocks=40))
    decode.block_manager.free_block_ids.move_to_end(0)  # a different free layout on the receiver
    rows = _rows([("all", 21, 7), ("attn", 9, 7), (None, 13, 7)])
    for i, (adapter, prompt, max_tokens) in enumerate(rows):
        prefill.add_request(str(i), prompt, _greedy(adapter, max_tokens), kv_transfer=KVTransfer.SEND)
    while prefill.has_work():
        prefill.step()
    assert all(s.num_running_requests == 0 for s in prefill.stats().adapters)  # held: its KV is done
    first_logprobs = [prefill.scheduler.held[str(i)].logprobs[0].logprob for i in range(len(rows))]
    outputs = {}
    for i in range(len(rows)):
        for out in _move_kv(prefill, decode, prefill.scheduler.held[str(i)], str(i)):
            outputs[out.request_id] = out
        assert prefill.abort_request(str(i))
    assert {s.name: s.num_running_requests for s in decode.stats().adapters} == {
        "attn": 1,
        "mlp": 0,
        "all": 1,
    }
    while decode.has_work():
        outputs.update({o.request_id: o for o in decode.step().outputs if o.finished})
    for i, (adapter, prompt, max_tokens) in enumerate(rows):
        got = outputs[str(i)].outputs[0]
        want_tokens, want_logprobs = _oracle("qwen2", adapter, tuple(prompt), max_tokens)
        assert got.token_ids == want_tokens, adapter
        got_logprobs = [first_logprobs[i]] + [e.logprob for e in got.logprobs]  # the first: prefill's
        assert got_logprobs == pytest.approx(want_logprobs, abs=ATOL), adapter
    assert decode.block_manager.num_free_blocks == 40


def test_decode_steps_with_adapter_rows_run_eagerly_beside_decode_graphs():
    # capture=False: the graphs' padded forward, eagerly (the CPU's stand-in for CUDA graphs,
    # which hold no LoRA): base-only decode steps take it, steps with adapter rows must not
    llm = _llm("llama", max_loras=3)
    runner = llm.engine.runner
    runner.use_decode_graphs(8, 128, capture=False)
    assert runner.graphs is not None
    real_run, graph_steps = runner.graphs.run, []
    runner.graphs.run = lambda *args: graph_steps.append(args[0].shape[0]) or real_run(*args)
    base_rows = _rows([(None, 6, 4)])
    _assert_exact("llama", base_rows, llm.generate([base_rows[0][1]], _greedy(None, 4)))
    assert graph_steps == [1, 1, 1]  # every decode step of a base row
    rows = _rows([("all", 6, 4), (None, 9, 4), ("attn", 5, 4)])
    graph_steps.clear()
    _assert_exact("llama", rows, llm.generate([p for _, p, _ in rows], [_greedy(a, m) for a, _, m in rows]))
    assert graph_steps == []


@pytest.mark.usefixtures("processes")
def test_a_mixed_batch_at_tp2_matches_peft_with_a_slot_refilled_on_both_ranks():
    llm = _llm("llama", tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        rows = _rows()
        outputs = llm.generate([p for _, p, _ in rows], [_greedy(a, m) for a, _, m in rows])
        _assert_exact("llama", rows, outputs)
        assert sum(s.num_evictions for s in llm.engine.stats().adapters) == 1
    finally:
        llm.engine.close()


# --------------------------------------------------------------------------- refusals


def test_an_unknown_adapter_is_refused_and_one_in_use_cannot_be_unloaded():
    llm = _llm("llama", lora_modules=_modules("llama", ("attn",)))
    engine = llm.engine
    with pytest.raises(UnknownAdapterError, match=r"adapter: 'nope' is not loaded \(loaded: 'attn'\)"):
        llm.generate([[5, 6, 7]], _greedy("nope", 2))
    engine.add_request("r", [5, 6, 7], _greedy("attn", 3))
    with pytest.raises(ValueError, match="adapter: 'attn' is in use by 1 requests"):
        engine.unload_adapter("attn")
    while engine.has_work():
        engine.step()
    engine.unload_adapter("attn")
    assert _names(engine) == () and engine.lora_adapters.lora.slots.num_free_slots == 2
    with pytest.raises(ValueError, match="adapter: 'attn' is not loaded"):
        engine.add_request("s", [5, 6, 7], _greedy("attn", 3))
    with pytest.raises(ValueError, match="adapter: 'attn' is not loaded"):
        engine.unload_adapter("attn")
    engine.load_adapter("attn", _adapters("llama")["attn"])  # back, by the runtime API
    with pytest.raises(ValueError, match="adapter: 'attn' is already loaded"):
        engine.load_adapter("attn", _adapters("llama")["attn"])
    # a request from a router may name the folder of an adapter this engine has not read yet
    rows = _rows([("all", 6, 4)])
    params = dataclasses.replace(_greedy("all", 4), adapter_path=_adapters("llama")["all"])
    _assert_exact("llama", rows, llm.generate([rows[0][1]], params))
    assert _names(engine) == ("attn", "all")


def test_an_adapter_above_max_lora_rank_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"'all': r = 16 exceeds --max-lora-rank 8"):
        _llm("llama", max_lora_rank=8)  # lora_modules are read at start
    llm = _llm("llama", max_lora_rank=8, lora_modules=())
    with pytest.raises(ValueError, match=r"'all': r = 16 exceeds --max-lora-rank 8"):
        llm.engine.load_adapter("all", _adapters("llama")["all"])
    params = SamplingParams(max_tokens=2, adapter="all", adapter_path=_adapters("llama")["all"])
    with pytest.raises(ValueError, match=r"'all': r = 16 exceeds --max-lora-rank 8"):
        llm.generate([[5, 6, 7]], params)
    assert _names(llm.engine) == ()


def test_without_enable_lora_adapters_are_refused_naming_the_field():
    path = str(make_tiny_model("llama"))
    for field, value in (("lora_modules", (("attn", "/x"),)), ("max_loras", 2), ("max_lora_rank", 8)):
        with pytest.raises(ValueError, match=f"{field} needs enable_lora"):
            EngineConfig(model=path, **{field: value})
    llm = LLM(path, num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="adapter: LoRA adapters are not enabled on this engine"):
        llm.generate([[5, 6, 7]], _greedy("attn", 2))
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters are not enabled"):
        llm.engine.load_adapter("attn", _adapters("llama")["attn"])
    with pytest.raises(ValueError, match="--enable-lora: GPT2LMHeadModel is not served"):
        LLM(str(make_tiny_model("gpt2")), enable_lora=True, num_kv_blocks=16)
