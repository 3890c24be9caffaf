"""pdserve's one-process LLM core: models, paged KV cache, block manager, scheduler, sampler.

``from engine import LLM, SamplingParams`` works as in vLLM. The names load lazily so that
torch-free modules (``protocol.sampling_params``, ``engine.block_hash``, ``engine.kv_layout``)
can be imported by the router without pulling in torch. Importing it sets the OpenMP wait
policy default (engine/cpu_env.py) while torch is not loaded yet.
"""

from __future__ import annotations

import importlib

from engine.cpu_env import apply_openmp_defaults

apply_openmp_defaults()  # before anything here imports torch (libgomp reads it once, at load)

_EXPORTS = {
    "LLM": "engine.llm",
    "SamplingParams": "protocol.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
