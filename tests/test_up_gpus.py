"""`pdserve up` on CUDA: each node's GPUs (launcher/gpus.py), checked on the CPU with the host's GPU
count faked (it is read from the driver, which this machine lacks)."""

from __future__ import annotations

import json

import pytest

from pdserve.cli.main import build_parser
from pdserve.launcher import gpus
from pdserve.launcher.cluster import LocalCluster
from pdserve.launcher.gpus import GpuLayout, plan_gpus, visible_gpu_count
from pdserve.launcher.plan import ClusterPlan
from pdserve.node.options import options_from_args
from pdserve.protocol.registry import Role


def test_nodes_take_disjoint_gpu_ranges_when_the_host_has_enough():
    layout = plan_gpus([2, 1, 1], first=0, num_gpus=4)  # a prefill node at tp 2, two decode nodes
    assert layout == GpuLayout((0, 2, 3), nodes_per_gpu=1)
    assert [layout.device_of(i) for i in range(3)] == ["cuda:0", "cuda:2", "cuda:3"]
    assert plan_gpus([2, 2], first=4, num_gpus=8).starts == (4, 6)  # from --device cuda:4


def test_one_rank_nodes_share_gpus_when_there_are_fewer_than_nodes():
    assert plan_gpus([1, 1], first=0, num_gpus=1) == GpuLayout((0, 0), nodes_per_gpu=2)
    assert plan_gpus([1, 1, 1], first=0, num_gpus=2) == GpuLayout((0, 1, 0), nodes_per_gpu=2)


@pytest.mark.parametrize(
    ("tps", "first", "num_gpus", "message"),
    [
        ([2, 2], 0, 2, "the nodes need 4 GPUs \\(2 \\+ 2 ranks\\) from cuda:0, but this host has 2 GPU"),
        ([1, 2], 0, 2, "need 3 GPUs"),  # a tp-2 node may not share its GPUs
        ([1, 1], 0, 0, "this host has 0 GPU"),
        ([2], 1, 2, "has 2 GPU\\(s\\), 1 from cuda:1"),
    ],
)
def test_a_layout_that_needs_more_gpus_than_the_host_has_is_refused(tps, first, num_gpus, message):
    with pytest.raises(ValueError, match=message):
        plan_gpus(tps, first, num_gpus)


def test_the_gpu_count_follows_cuda_visible_devices_or_the_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,1")  # CUDA stops at an invalid id
    assert visible_gpu_count() == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    for i in range(3):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    monkeypatch.setattr(gpus, "NVIDIA_GPUS", tmp_path)
    assert visible_gpu_count() == 3
    monkeypatch.setattr(gpus, "NVIDIA_GPUS", tmp_path / "absent")
    assert visible_gpu_count() == 0


def _model(tmp_path):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    config = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "dtype": "float32"}
    (model / "config.json").write_text(json.dumps(config))
    return model


def _up_plan(tmp_path, monkeypatch, num_gpus: int, *flags: str) -> ClusterPlan:
    from pdserve.cli.up import _plan

    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: num_gpus)  # the fake: no driver here
    argv = ["up", "--model", str(_model(tmp_path)), "--log-dir", str(tmp_path / "logs"), "--oversubscribe"]
    return _plan(build_parser().parse_args([*argv, *flags]))


def _engine_of(plan: ClusterPlan, role: str, index: int):
    argv = LocalCluster(plan).node_argv(role, index)
    command = "prefill" if role == "prefill" else "decode"
    args = build_parser().parse_args(argv[argv.index(command) :])
    return options_from_args(Role.PREFILL if role == "prefill" else Role.DECODE, args)[1]


def test_up_gives_each_node_its_own_gpus_on_a_four_gpu_host(tmp_path, monkeypatch):
    plan = _up_plan(
        tmp_path, monkeypatch, 4, "--prefill-tp", "2", "--decode", "2", "--node-args", "--device cuda"
    )
    prefill, decode0, decode1 = (_engine_of(plan, *n) for n in (("prefill", 0), ("decode", 0), ("decode", 1)))
    assert (prefill.device, decode0.device, decode1.device) == ("cuda:0", "cuda:2", "cuda:3")
    assert prefill.tensor_parallel_size == 2  # its ranks on cuda:0 and cuda:1
    assert prefill.gpu_memory_utilization == decode0.gpu_memory_utilization == 0.9  # alone on theirs


def test_up_shares_one_gpu_between_two_one_rank_nodes(tmp_path, monkeypatch):
    plan = _up_plan(tmp_path, monkeypatch, 1, "--node-args", "--device cuda")
    prefill, decode = _engine_of(plan, "prefill", 0), _engine_of(plan, "decode", 0)
    assert prefill.device == decode.device == "cuda:0"
    assert prefill.gpu_memory_utilization == decode.gpu_memory_utilization == 0.45


def test_up_refuses_a_layout_that_needs_more_gpus_before_starting_anything(tmp_path, monkeypatch):
    with pytest.raises(
        ValueError, match="the nodes need 4 GPUs \\(2 \\+ 2 ranks\\) from cuda:0, but this host has 2"
    ):
        _up_plan(
            tmp_path, monkeypatch, 2, "--prefill-tp", "2", "--decode-tp", "2", "--node-args", "--device cuda"
        )
    assert not list((tmp_path / "logs").glob("*.log"))
    plan = _up_plan(tmp_path, monkeypatch, 0, "--node-args", "--device cpu")  # off CUDA: no count needed
    assert plan.gpu_layout is None
