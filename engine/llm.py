"""Offline batch generation, shaped like vLLM's ``LLM``, with a lifecycle.

An ``LLM`` owns an engine, and at ``tensor_parallel_size`` > 1 the engine owns worker processes
and this process's torch.distributed group, of which a process has one. So the engine is closed
(workers stopped, the group destroyed) when the ``LLM`` is: by ``close()``, at the end of a
``with`` block, or when the last reference to it goes (a ``weakref.finalize``, which also runs at
interpreter exit). After any of these another ``LLM`` of any size can start in the process.

A finalizer rather than ``__del__``: it runs at most once, at interpreter exit before modules are
torn down (a ``__del__`` may run after, or on an object whose ``__init__`` raised half-way), and
it holds the engine, never the ``LLM``, so it cannot keep its own object alive. The ``LLM`` is in
no reference cycle, so dropping the last reference closes the engine at once, without waiting for
the garbage collector (the engine's own cycles are collected later, freeing its memory; closing
has already stopped everything that ran).
"""

from __future__ import annotations

import itertools
import pathlib
import weakref
from collections.abc import Sequence as Seq
from types import TracebackType

from pdserve.engine.machine.cpu_env import apply_openmp_defaults

apply_openmp_defaults()  # offline use's entry point: before the engine below loads torch

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core.outputs import RequestOutput  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.protocol.sampling_params import SamplingParams  # noqa: E402

Prompt = str | list[int]


def load_tokenizer(model_dir: str):
    """The model folder's tokenizer, or None when it ships none (bare test checkpoints)."""
    if (
        not (pathlib.Path(model_dir) / "tokenizer_config.json").is_file()
        and not (pathlib.Path(model_dir) / "tokenizer.json").is_file()
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class LLM:
    """``LLM(model, **engine_options)``: ``EngineConfig``'s fields as keyword arguments, e.g.
    ``tensor_parallel_size=2``. Close it when done (``close()`` or ``with LLM(...) as llm:``);
    dropping the last reference closes it too."""

    def __init__(self, model: str, **engine_options) -> None:
        tokenizer = load_tokenizer(str(model))
        engine = LLMEngine(EngineConfig(model=str(model), **engine_options), tokenizer)
        self._engine: LLMEngine | None = engine
        self._tokenizer = tokenizer
        self._closer = weakref.finalize(self, engine.close)  # holds the engine, not self
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        """The engine this ``LLM`` drives; RuntimeError once it is closed."""
        if self._engine is None:
            raise RuntimeError("this LLM is closed: make a new LLM(...) to generate again")
        return self._engine

    @property
    def closed(self) -> bool:
        return self._engine is None

    def close(self) -> None:
        """Stop the engine: its worker ranks exit and the tensor-parallel group is destroyed, so
        that another ``LLM`` can start in this process. A second call does nothing."""
        self._engine = None  # the engine's memory goes with the garbage collector's next pass
        self._closer()  # runs engine.close once, then lets go of the engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def get_tokenizer(self):
        return self._tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine  # RuntimeError once closed, before anything is queued
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        token_lists = [self._encode(p) for p in prompts]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        finished: dict[str, RequestOutput] = {}
        try:
            for request_id, tokens, p in zip(ids, token_lists, params, strict=True):
                engine.add_request(request_id, tokens, p)  # all or nothing: a refusal aborts the rest
            while len(finished) < len(ids):
                for out in engine.step().outputs:
                    if out.finished:
                        finished[out.request_id] = out
        finally:
            for request_id in ids:
                if request_id not in finished:
                    engine.abort_request(request_id)
        return [finished[i] for i in ids]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            tokenizer = self.get_tokenizer()
            if tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer in the model folder; pass token ids")
            return tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    for p in prompts:
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise ValueError("prompt: each prompt must be a string or a list of token ids")
    return prompts
