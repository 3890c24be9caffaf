"""Fixtures of the chaos suite: one cluster per module (faults replace what they break)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import Cluster, Expected
from tests.test_router_cluster import tiny_model_with_tokenizer


@pytest.fixture(scope="module")
def model(default_model_dir):
    return tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def expected(model):
    return Expected(model)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model):
    c = Cluster(tmp_path_factory.mktemp("chaos"), model)
    try:
        yield c
    finally:
        c.close()
