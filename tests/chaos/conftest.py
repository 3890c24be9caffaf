"""Fixtures of the chaos suite: a 2P+2D cluster (on Redis, and with static addresses) and a small 1P+1D
one, each started once per session."""

from __future__ import annotations

import pytest

from tests.chaos.harness import Cluster, Router
from tests.chaos.load import Expected
from tests.test_router_cluster import tiny_model_with_tokenizer

ADMITTED = 12  # the tight router's --max-inflight-decode
REDIS_PASSWORD = "s3cret-pw"  # the small cluster's Redis needs it (requirepass)
API_KEY = "sk-test-0123456789"  # the small cluster's guarded router wants it


@pytest.fixture(scope="session")
def model(default_model_dir):
    return tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=1024)


@pytest.fixture(scope="session")
def expected(model):
    return Expected(model)


@pytest.fixture(scope="session")  # faults replace what they break: the next case finds it whole
def redis_cluster(tmp_path_factory, model):
    c = Cluster(tmp_path_factory.mktemp("chaos"), model)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="session")
def static_cluster(tmp_path_factory, model):
    """The same cluster with static node addresses and no Redis (``pdserve up --no-redis``)."""
    c = Cluster(tmp_path_factory.mktemp("chaos-static"), model, static=True)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="session")
def cluster(redis_cluster):
    """The Redis cluster; test_chaos_node_faults.py runs its faults on both registry modes."""
    return redis_cluster


@pytest.fixture(scope="session")  # shared by the overload, bad-input and security modules
def small(tmp_path_factory, model):
    """1 prefill + 1 decode node on a Redis with a password, and three routers: the default one,
    one admitting ADMITTED requests, one wanting API_KEY."""
    tmp = tmp_path_factory.mktemp("small")
    cluster = Cluster(tmp, model, roles=("prefill", "decode"), redis_password=REDIS_PASSWORD)
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
    guarded = Router(model, cluster.redis.url, tmp, "--api-key", API_KEY, "--disagg-threshold", "8")
    try:
        tight.wait_healthy()
        guarded.wait_healthy()
        yield cluster, tight, guarded
    finally:
        tight.close()
        guarded.close()
        cluster.close()
