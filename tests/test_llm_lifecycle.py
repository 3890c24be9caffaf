"""The offline ``LLM``'s lifecycle (engine/llm.py): ``close()``, ``with LLM(...)``, and release when
the last reference goes. Three tensor-parallel LLMs run one after another in this process, the
next after the previous was deleted (no close, no gc.collect()), then closed, and each gives
Hugging Face's greedy tokens; closing twice is harmless, a closed LLM refuses to generate and lets
its engine be collected; and the process's one torch.distributed group is refused to a second
engine while held, and destroyed only by the engine that formed it (engine/executor/parallel.py)."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch.distributed as dist

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.executor.parallel import close_parallel, init_parallel
from pdserve.launcher.ports import free_port
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> str:
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def hf_tokens(model) -> list[int]:
    return hf_greedy(model, PROMPT, GREEDY.max_tokens)


def _llm(model: str, tp: int = 1) -> LLM:
    return LLM(model, tensor_parallel_size=tp, num_kv_blocks=16, block_size=8)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def _collected(ref: weakref.ref, within_s: float = 10.0) -> bool:
    """Whether ``ref``'s object goes once collected (a tp engine's monitor thread lets go of it
    within a second of the close)."""
    deadline = time.monotonic() + within_s
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    return ref() is None


@pytest.mark.usefixtures("processes")
def test_tp2_llms_run_one_after_another_after_a_del_and_after_a_close(model, hf_tokens):
    first = _llm(model, tp=2)
    workers = [w.proc for w in first.engine.executor.workers]
    assert len(workers) == 1 and _tokens(first) == hf_tokens
    del first  # the last reference: the engine closes now, without waiting for the collector
    assert all(proc.poll() is not None for proc in workers) and not dist.is_initialized()

    second = _llm(model, tp=2)
    workers = [w.proc for w in second.engine.executor.workers]
    engine = weakref.ref(second.engine)
    assert _tokens(second) == hf_tokens
    second.close()
    assert all(proc.poll() is not None for proc in workers) and not dist.is_initialized()
    assert _collected(engine), "nothing may keep a closed engine alive"

    with _llm(model, tp=2) as third:
        assert _tokens(third) == hf_tokens
    assert third.closed and not dist.is_initialized()


def test_closing_twice_is_harmless_and_a_closed_llm_refuses_to_generate(model, hf_tokens):
    llm = _llm(model)
    assert not llm.closed and _tokens(llm) == hf_tokens
    llm.close()
    llm.close()
    assert llm.closed
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate([PROMPT], GREEDY)
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.engine  # noqa: B018 - the property is what is checked
    assert llm.get_tokenizer() is None  # the tiny model ships none; the call still answers


def test_the_with_block_closes_the_llm_when_its_body_raises(model):
    with pytest.raises(ValueError, match="the body failed"):
        with _llm(model) as llm:
            engine = weakref.ref(llm.engine)
            raise ValueError("the body failed")
    assert llm.closed
    assert _collected(engine), "nothing may keep a closed engine alive"


def _group_of_one():
    return init_parallel(1, 0, f"tcp://127.0.0.1:{free_port()}", "gloo", 30.0, group_of_one=True)


def test_a_second_group_is_refused_naming_how_to_free_the_first():
    held = _group_of_one()
    try:
        with pytest.raises(RuntimeError, match=r"close it first \(LLM.close\(\)"):
            _group_of_one()
        assert dist.group.WORLD is held.group  # the refusal left the holder's group alone
    finally:
        close_parallel(held)
    assert not dist.is_initialized()


def test_closing_an_old_group_again_leaves_the_newer_engines_group_alone():
    old = _group_of_one()
    close_parallel(old)
    new = _group_of_one()
    try:
        close_parallel(old)  # e.g. an engine closed once by hand, then by its LLM's finalizer
        assert dist.is_initialized() and dist.group.WORLD is new.group
    finally:
        close_parallel(new)
    assert not dist.is_initialized()
