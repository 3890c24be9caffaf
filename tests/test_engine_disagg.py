"""Prefill-only requests hand their KV to another engine, which decodes on: exact against HF."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_connector import HeldKV, KVTransfer
from pdserve.engine.core.requests import Aborted
from pdserve.engine.core.sequence import Sequence, SequenceStatus
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import ops
from tests.engine_helpers import grant_remote, hf_greedy
from tests.tiny_models import make_tiny_model


def _move_kv(src: LLMEngine, dst: LLMEngine, seq: Sequence, request_id: str) -> list:
    """What kv_transfer does over the wire, done in-process: reserve, gather, scatter, arrive.
    Returns the outputs of the steps it took (the grant's); the arrival is the next step's."""
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    reservation, outputs = grant_remote(dst, request_id, list(prompt), seq.params)
    held = reservation.num_held_blocks
    src_k = [k for k, _ in src.runner.kv_caches]
    src_v = [v for _, v in src.runner.kv_caches]
    buf = ops.gather_blocks(src_k, src_v, torch.tensor(seq.block_table[held:]))
    ops.scatter_blocks(
        buf,
        [k for k, _ in dst.runner.kv_caches],
        [v for _, v in dst.runner.kv_caches],
        torch.tensor(reservation.block_ids),
    )
    dst.kv_connector.kv_arrived(request_id, seq.token_ids[-1])
    return outputs


def test_prefill_only_then_decode_elsewhere_matches_hf():
    path = str(make_tiny_model("qwen2"))
    prefill = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8))
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=40, block_size=8))
    decode.block_manager.free_block_ids.move_to_end(0)  # different free layout on the receiver
    prompts = {"a": list(range(3, 40)), "b": list(range(50, 61))}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt, params, kv_transfer=KVTransfer.SEND)
    while prefill.has_work():
        prefill.step()
    assert set(prefill.scheduler.held) == {"a", "b"}
    for rid in prompts:
        _move_kv(prefill, decode, prefill.scheduler.held[rid], rid)
        assert prefill.kv_connector.send_finished(rid)
    prefill.step()  # the ended sends' blocks go back
    assert prefill.block_manager.num_free_blocks == 32
    results = {}
    while decode.has_work():
        for out in decode.step().outputs:
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    for rid, prompt in prompts.items():
        assert results[rid] == hf_greedy(path, prompt, 12)
    assert decode.block_manager.num_free_blocks == 40


def test_first_token_that_ends_the_request_finishes_at_adoption():
    path = str(make_tiny_model("llama"))
    prefill = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=8))
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=8))
    prefill.add_request(
        "x", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=9), kv_transfer=KVTransfer.SEND
    )
    prefill.step()
    held = prefill.scheduler.held["x"]
    decode_params = SamplingParams(temperature=0.0, max_tokens=1)  # the decode node's limit: one token
    reservation, _ = grant_remote(decode, "x", [5, 6, 7], decode_params)
    decode.kv_connector.kv_arrived("x", held.token_ids[-1])
    (out,) = decode.step().outputs
    assert (
        out.finished
        and out.outputs[0].finish_reason == "length"
        and out.outputs[0].token_ids == [held.token_ids[-1]]
    )
    assert decode.block_manager.num_free_blocks == 16
    assert prefill.abort_request("x") is Aborted.KV_OUTBOUND  # abort releases held blocks too
    assert prefill.block_manager.num_free_blocks == 16


def _prefilled(path: str, prompts: dict[str, list[int]], max_tokens: int) -> LLMEngine:
    prefill = LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=8))
    for rid, prompt in prompts.items():
        prefill.add_request(
            rid,
            prompt,
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            kv_transfer=KVTransfer.SEND,
        )
    while prefill.has_work():
        prefill.step()
    return prefill


def test_remote_reservations_wait_in_the_fifo_of_local_prompts_and_count_as_running():
    """Reservations queue with local prompts for slots and blocks (no overtaking either way) and
    are granted by the same schedule, under max_num_seqs; a granted one holds its slot until its
    KV lands."""
    path = str(make_tiny_model("llama"))
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=8, max_num_seqs=2))
    granted: list[str] = []

    def step() -> None:
        granted.extend(r.request_id for r in decode.step().kv.granted)

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    decode.kv_connector.reserve("a", list(range(3, 20)), params)
    decode.add_request("local", list(range(30, 40)), params)
    assert not granted  # granted by a step's schedule, not at once
    step()  # "a" heads the queue: granted by a step that computes nothing (its sender starts now)
    assert granted == ["a"] and decode.scheduler.num_seqs == 1 and not decode.scheduler.running
    step()  # "local" runs: now they fill max_num_seqs
    assert decode.scheduler.num_seqs == 2
    decode.kv_connector.reserve("b", list(range(50, 60)), params)
    decode.add_request("queued", list(range(60, 70)), params)
    step()
    assert granted == ["a"]
    assert [s.request_id for s in decode.scheduler.waiting] == ["b", "queued"]  # one FIFO
    assert decode.stats().num_waiting == 2 and decode.stats().num_receiving == 1
    assert decode.stats().num_queued_prefill_tokens == 10  # only "queued" is computed here
    assert decode.abort_request("a") is Aborted.KV_INBOUND  # its transfer failed: blocks and slot back
    step()
    assert granted == ["a", "b"]  # the head first: "queued" stays behind it, out of slots
    assert [s.request_id for s in decode.scheduler.waiting] == ["queued"]
    assert decode.abort_request("b") is Aborted.KV_INBOUND
    assert decode.abort_request("queued") is Aborted.LOCAL and not decode.abort_request("queued")
    decode.block_manager.check_integrity([*decode.scheduler.running, *decode.scheduler.receiving])


def test_a_reservation_passes_local_prompts_that_wait_only_for_compute_budget():
    """A long local prompt takes every step's token budget; the local prompt behind it waits for
    budget, and the reservation behind that one, which needs none, is granted at the next step
    (the later local prompt stays behind the first). The outputs stay HF's."""
    path = str(make_tiny_model("llama"))
    decode = LLMEngine(
        EngineConfig(model=path, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16, max_step_s=1e3)
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    decode.add_request("long", list(range(3, 83)), params)  # 80 tokens: 5 steps of 16
    decode.step()
    decode.add_request("second", list(range(90, 110)), params)
    decode.kv_connector.reserve("remote", list(range(120, 140)), params)
    decode.add_request("third", list(range(150, 160)), params)
    granted = [r.request_id for r in decode.step().kv.granted]
    assert granted == ["remote"]
    assert [s.request_id for s in decode.scheduler.waiting] == ["second", "third"]
    assert decode.abort_request("remote") is Aborted.KV_INBOUND
    outputs = {}
    while decode.has_work():
        for out in decode.step().outputs:
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    for request_id, prompt in (
        ("long", range(3, 83)),
        ("second", range(90, 110)),
        ("third", range(150, 160)),
    ):
        assert list(outputs[request_id]) == hf_greedy(path, list(prompt), 4), request_id


def test_a_reservation_that_does_not_fit_stalls_the_loop_until_something_ends():
    """has_work turns False while the head cannot be granted (no busy loop), and True again
    once blocks come back."""
    path = str(make_tiny_model("llama"))
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=8, block_size=8))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    decode.kv_connector.reserve("big", list(range(3, 43)), params)  # 5 blocks of 8
    decode.step()
    decode.kv_connector.reserve("next", list(range(50, 82)), params)  # 4 blocks: 3 are left
    assert decode.has_work()
    decode.step()
    assert not decode.has_work() and decode.scheduler.waiting[0].request_id == "next"
    decode.abort_request("big")
    assert decode.has_work()
    decode.step()
    assert decode.stats().num_receiving == 1 and not decode.scheduler.waiting


def test_remote_reservation_reuses_cached_prefix_blocks_and_decodes_equal_to_hf():
    path = str(make_tiny_model("llama"))
    shared = list(range(3, 27))  # 3 full blocks of 8
    prompts = {"first": [*shared, 40, 41], "second": [*shared, 50, 51, 52]}
    prefill = _prefilled(path, prompts, 6)
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8))
    outs = {}
    for rid in prompts:
        reservation, _ = grant_remote(decode, rid, prompts[rid], prefill.scheduler.held[rid].params)
        assert reservation.num_held_blocks == (0 if rid == "first" else 3)
        decode.abort_request(rid)
        _move_kv(prefill, decode, prefill.scheduler.held[rid], rid)
        while decode.has_work():
            for out in decode.step().outputs:
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
    assert outs == {rid: hf_greedy(path, p, 6) for rid, p in prompts.items()}


def test_a_prefill_only_request_is_held_for_transfer_by_the_scheduler_until_released():
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=8, debug_checks=True))
    prompt = list(range(3, 23))
    engine.add_request(
        "h", prompt, SamplingParams(temperature=0.0, max_tokens=9), kv_transfer=KVTransfer.SEND
    )
    step = engine.step()
    (out,) = step.outputs
    assert out.finished and out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
    seq = engine.scheduler.held["h"]
    (held,) = step.kv.held  # what the node ships: the prompt and its blocks
    assert held == HeldKV("h", tuple(prompt), tuple(seq.block_table), seq.first_scheduled_time)
    assert len(held.block_ids) == 3  # 21 tokens' KV kept for the transfer
    assert seq.status is SequenceStatus.HELD_FOR_TRANSFER and not seq.is_finished
    assert not engine.has_work() and engine.scheduler.num_seqs == 0  # out of the batch
    assert engine.block_manager.num_free_blocks == 16 - 3
    engine.scheduler.check_integrity()  # held blocks are accounted to their holder
    with pytest.raises(ValueError, match="already in use"):  # its id stays taken while held
        engine.add_request("h", [1, 2], SamplingParams(max_tokens=2))
    assert engine.kv_connector.send_finished("h") and not engine.kv_connector.send_finished("h")
    assert engine.has_work() and engine.block_manager.num_free_blocks == 16 - 3  # the next step frees them
    assert engine.step().outputs == []
    assert seq.status is SequenceStatus.FINISHED_LENGTH and "h" not in engine.scheduler.held
    assert engine.block_manager.num_free_blocks == 16 and not engine.has_work()
    assert engine.abort_request("h") is Aborted.UNKNOWN
    engine.scheduler.check_integrity()


def test_an_aborted_prefill_only_request_is_never_held():
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=4, max_num_batched_tokens=8))
    engine.add_request("a", list(range(3, 30)), SamplingParams(temperature=0.0), kv_transfer=KVTransfer.SEND)
    engine.step()  # one chunk of the prompt computed
    assert engine.abort_request("a")
    assert "a" not in engine.scheduler.held and engine.block_manager.num_free_blocks == 16


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_k=50, seed=11, max_tokens=24, ignore_eos=True, frequency_penalty=0.5
        ),
    ],
    ids=["greedy", "seeded-with-penalty"],
)
def test_a_resumed_request_continues_exactly_where_another_engine_stopped(params):
    """Migration's engine half: prompt + the output so far, recomputed, go on as if uninterrupted."""
    path = str(make_tiny_model("llama"))
    prompt = list(range(3, 40))

    def run(engine, resume=()):
        engine.add_request(
            "r", prompt, dataclasses.replace(params, logprobs=0), resume_output_ids=tuple(resume)
        )
        while True:
            for out in engine.step().outputs:
                if out.finished:
                    return out.outputs[0]

    whole = run(LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8)))
    resumed = run(LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8)), whole.token_ids[:9])
    assert resumed.token_ids == whole.token_ids  # the resumed 9, then the same 15 after them
    assert [lp.token_id for lp in resumed.logprobs] == whole.token_ids[9:]  # logprobs of new tokens only
    for lp, want in zip(resumed.logprobs, whole.logprobs[9:], strict=True):
        assert abs(lp.logprob - want.logprob) < 1e-4


def test_resume_output_ids_are_checked():
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8))
    with pytest.raises(ValueError, match="output_token_ids"):
        engine.add_request("a", [5, 6], SamplingParams(max_tokens=3), resume_output_ids=(1, 2, 3))
    with pytest.raises(ValueError, match="output_token_ids"):
        engine.add_request(
            "b", [5, 6], SamplingParams(max_tokens=9), kv_transfer=KVTransfer.SEND, resume_output_ids=(1,)
        )
    with pytest.raises(ValueError, match="output_token_ids"):
        engine.add_request("c", [5, 6], SamplingParams(max_tokens=9), resume_output_ids=(10**9,))


def test_decodes_that_arrive_behind_a_local_prompt_run_every_step_and_stay_exact():
    """A decode node chunking a long local prompt (the router's decode-local prefill) adopts
    remote KV: the adopted rows join ``running`` after the prompt, and still decode every step
    instead of waiting out its prefill."""
    path = str(make_tiny_model("llama"))
    prefill = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=8))
    decode = LLMEngine(
        EngineConfig(model=path, num_kv_blocks=96, block_size=8, max_num_batched_tokens=32, max_step_s=1e3)
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    long_prompt = [(11 * i) % 250 + 3 for i in range(320)]  # ten 32-token chunks
    decode.add_request("local", long_prompt, dataclasses.replace(params, max_tokens=2))
    decode.step()
    remote = {"r1": list(range(3, 20)), "r2": list(range(40, 49))}
    for rid, prompt in remote.items():
        prefill.add_request(rid, prompt, params, kv_transfer=KVTransfer.SEND)
    while prefill.has_work():
        prefill.step()
    results: dict[str, list[int]] = {}
    for rid in remote:
        _move_kv(prefill, decode, prefill.scheduler.held[rid], rid)
        assert prefill.abort_request(rid) is Aborted.KV_OUTBOUND
    steps = 0
    while "r1" not in results or "r2" not in results:
        outs = decode.step().outputs
        steps += 1
        assert {o.request_id for o in outs} >= {"r1", "r2"} - set(results), steps  # every step
        for out in outs:
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert steps == 5  # the first token came with the KV; five steps, while "local" still prefills
    local = decode.scheduler.running[0]
    assert local.request_id == "local" and local.num_computed_tokens < len(long_prompt)
    for rid, prompt in remote.items():
        assert results[rid] == hf_greedy(path, prompt, 6)
    while decode.has_work():
        for out in decode.step().outputs:
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert results["local"] == hf_greedy(path, long_prompt, 2)
    assert decode.block_manager.num_free_blocks == 96


@pytest.mark.parametrize(
    ("params", "continues"),
    [
        (SamplingParams(temperature=0.0, max_tokens=9), True),  # goes on on the decode node
        (SamplingParams(temperature=0.0, max_tokens=1), False),  # its first token was its last
    ],
)
def test_a_prefill_only_request_is_held_only_when_it_goes_on(params, continues):
    """The engine holds a sent prompt's KV only while the request goes on on the decode node; a
    first token that ends the request frees its blocks at once (the node sends it as the last)."""
    path = str(make_tiny_model("llama"))
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=16, block_size=8))
    engine.add_request("p", list(range(3, 13)), params, kv_transfer=KVTransfer.SEND)
    step = engine.step()
    (out,) = step.outputs
    assert out.finished and [h.request_id for h in step.kv.held] == (["p"] if continues else [])
    assert engine.abort_request("p") is (Aborted.KV_OUTBOUND if continues else Aborted.UNKNOWN)
    first = out.outputs[0].token_ids[0]
    # the same first token with the request's own limit and a stop token: it ends the request
    engine.add_request(
        "q",
        list(range(3, 13)),
        SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=(first,)),
        kv_transfer=KVTransfer.SEND,
    )
    step = engine.step()
    (out,) = step.outputs
    assert step.kv.held == () and out.outputs[0].finish_reason == "stop"
    assert engine.block_manager.num_free_blocks == 16
