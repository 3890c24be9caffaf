"""`pdserve up` shares the machine's memory among its nodes' KV pools: without it every node would
size its pool as if alone (25% of free memory each), and four or more nodes could together take
all of it once their pools fill."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cli.main import build_parser
from pdserve.engine.config import EngineConfig
from pdserve.launcher.cluster import LocalCluster
from pdserve.launcher.plan import LOCAL_KV_SHARE, kv_fraction_per_node
from pdserve.node.options import options_from_args
from pdserve.protocol.registry import Role
from tests.test_up import plan_of
from tests.tiny_models import make_tiny_model


def test_the_launchers_default_is_the_engines():
    engine_default = {f.name: f.default for f in dataclasses.fields(EngineConfig)}["kv_cache_memory_fraction"]
    assert engine_default == 0.25  # kv_fraction_per_node's own default
    assert kv_fraction_per_node(1) is None and kv_fraction_per_node(2) is None
    assert kv_fraction_per_node(10) == LOCAL_KV_SHARE / 10


@pytest.mark.parametrize(
    ("num_prefill", "num_decode", "node_args", "want"),
    [
        (1, 1, (), 0.25),  # two nodes: the engine's own default, no flag
        (2, 2, (), 0.125),
        (3, 5, (), 0.0625),
        (2, 2, ("--kv-cache-memory-fraction", "0.3"), 0.3),  # the user's flag wins
    ],
)
def test_each_node_of_a_local_cluster_gets_its_share_of_memory(
    tmp_path, num_prefill, num_decode, node_args, want
):
    model = str(make_tiny_model("llama"))
    plan = plan_of(tmp_path, model=model, num_prefill=num_prefill, num_decode=num_decode, node_args=node_args)
    fractions = []
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        for index in range(count):
            argv = LocalCluster(plan).node_argv(role, index)
            args = build_parser().parse_args(argv[argv.index(role) :])
            fractions.append(options_from_args(Role(role), args)[1].kv_cache_memory_fraction)
    assert fractions == [want] * (num_prefill + num_decode)
    if not node_args:  # the pools together stay within the local share (two nodes: 25% each, as alone)
        assert sum(fractions) <= max(LOCAL_KV_SHARE, 2 * 0.25)
