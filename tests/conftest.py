"""Shared test set-up: no model hub, gpu-marked tests skipped without CUDA, the default model.

Markers (gpu, slow) are declared in pyproject.toml's [tool.pytest.ini_options], not here.
"""

from __future__ import annotations

import os
import pathlib

import pytest

# Set before any test imports transformers or huggingface_hub, which read them once:
# the tests must never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when gpu tests were collected: torch is slow to import

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu test: torch.cuda.is_available() is false")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> pathlib.Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder.

    Converted once into the shared cache ($PDSERVE_CACHE or ~/.cache/pdserve, about 30 s and
    520 MB the first time); later sessions find it there.
    """
    from pdserve.engine.model_fetch import fetch_default_model

    return fetch_default_model(progress=False)
