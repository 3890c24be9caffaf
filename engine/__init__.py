"""pdserve's one-process LLM core: models, paged KV cache, block manager, scheduler, sampler.

``from pdserve.engine import LLM, SamplingParams`` works as in vLLM (``from pdserve import ...`` too). The names load lazily so that
torch-free modules can be imported without pulling in torch. Importing it has no side effect:
the OpenMP wait default (engine/machine/cpu_env.py) is set by the process entry points, the ``pdserve``
command and ``pdserve.engine.llm`` (offline use), before they load torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "pdserve.engine.llm",
    "SamplingParams": "pdserve.protocol.sampling_params",
    "RequestOutput": "pdserve.engine.core.outputs",
    "CompletionOutput": "pdserve.engine.core.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
