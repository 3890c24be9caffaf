"""pdserve: LLM serving with disaggregated prefill and decode over a paged KV cache.

``from pdserve import LLM, SamplingParams`` is the offline engine, as in vLLM; the names load
lazily, so importing ``pdserve`` (or a torch-free part such as ``pdserve.router``) loads no torch.

Where the code lives. Each subpackage ``pdserve.X`` is the repository's top-level folder ``X/``
(``pdserve.router`` is ``router/``, ``pdserve.kernels`` is ``kernels/``): ``pdserve/X`` is a
relative symbolic link to ``../X``. That one mechanism serves every reader. Python's own path
finder follows it from a checkout (``python -m pdserve`` from the repository root, an editable
install, the GPU one-shot's bare interpreter); setuptools copies the files behind it into the
wheel and the sdist, so an install holds real folders under ``pdserve/`` and nothing else at
site-packages' top level; and tools that resolve imports from files (mypy, pyright, an IDE, an
import-graph reader) find ``pdserve/engine/llm_engine.py`` where the import says it is. This
folder's own code is the package root and the command line (``pdserve.cli``).

``kernels/`` has no ``__init__.py`` (a namespace package): from the repository root, where the
root is on ``sys.path``, a bare ``import kernels`` then still finds Hugging Face's ``kernels``
package, which transformers imports, and never this folder.
"""

from __future__ import annotations

import importlib

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]  # pdserve.engine's, lazily


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("pdserve.engine"), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
