"""pdserve: LLM serving with disaggregated prefill and decode over a paged KV cache.

``from pdserve import LLM, SamplingParams`` is the offline engine, as in vLLM; the names load
lazily, so importing ``pdserve`` (or a torch-free part such as ``pdserve.router``) loads no torch.

Where the code lives. Each subpackage ``pdserve.X`` is the repository's top-level folder ``X/``
(``pdserve.router`` is ``router/``, ``pdserve.kernels`` is ``kernels/``); this folder holds only
the package root and the command line (``pdserve.cli``). A wheel installs them all under one
``pdserve/`` (pyproject.toml's package-dir), so nothing else lands at site-packages' top level.
In a checkout, installed editable or not installed at all (``python -m pdserve`` from the
repository root, the GPU one-shot's bare interpreter), ``_CheckoutFolders`` maps the names.

``kernels/`` has no ``__init__.py`` (a namespace package): from the repository root, where the
root is on ``sys.path``, a bare ``import kernels`` then still finds Hugging Face's ``kernels``
package, which transformers imports, and never this folder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import pathlib
import sys

# The top-level folders that are subpackages of pdserve (pyproject.toml's package-dir lists the same).
SUBPACKAGES = (
    "bench_serve",
    "decode_node",
    "detok",
    "engine",
    "grammar",
    "kernels",
    "kv_transfer",
    "launcher",
    "node",
    "planner",
    "prefill_node",
    "protocol",
    "router",
)

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]  # pdserve.engine's, lazily


class _CheckoutFolders(importlib.abc.MetaPathFinder):
    """Finds ``pdserve.X`` in the checkout's top-level folder ``X/`` (deeper names follow from its path)."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.partition(".")
        if parent != __name__ or name not in SUBPACKAGES:
            return None
        folder = self.root / name
        init = folder / "__init__.py"
        if init.is_file():
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=[str(folder)]
            )
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]  # a namespace package (kernels/)
        return spec


def _map_checkout_folders() -> None:
    here = pathlib.Path(__file__).resolve().parent
    if (here / "engine").is_dir() or not (here.parent / "engine").is_dir():
        return  # installed from a wheel: the subpackages are folders of this one
    if not any(isinstance(finder, _CheckoutFolders) for finder in sys.meta_path):
        # First: ahead of setuptools' editable finder, which maps these names too but not kernels/.
        sys.meta_path.insert(0, _CheckoutFolders(here.parent))


_map_checkout_folders()


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("pdserve.engine"), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
