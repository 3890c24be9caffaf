"""Fixtures of the chaos suite: one cluster per module (faults replace what they break)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import Cluster, Expected, Router
from tests.test_router_cluster import tiny_model_with_tokenizer

ADMITTED = 12  # the tight router's --max-inflight-decode


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


@pytest.fixture(scope="module")
def small(tmp_path_factory, model):
    """1 prefill + 1 decode node with two routers: the default one and one admitting ADMITTED."""
    tmp = tmp_path_factory.mktemp("small")
    cluster = Cluster(tmp, model, roles=("prefill", "decode"))
    tight = Router(
        model,
        cluster.redis.url,
        tmp,
        "--max-inflight-decode",
        str(ADMITTED),
        "--max-inflight-prefill",
        str(ADMITTED // 2),
        "--disagg-threshold",
        "32",
    )
    try:
        tight.wait_healthy()
        yield cluster, tight
    finally:
        tight.close()
        cluster.close()
