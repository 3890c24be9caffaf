"""`pdserve status`: the pools table, exact for fixed records, and read from a real Redis."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pdserve.cli.main import build_parser, main
from pdserve.cli.status import render
from pdserve.protocol.fingerprint import KVFingerprint
from pdserve.protocol.registry import NodeInfo, Role, publish
from tests.cluster import RedisServer, free_port

PREFILL = NodeInfo(
    node_id="prefill-a",
    role=Role.PREFILL,
    control_addr="tcp://10.0.0.2:5001",
    kv_addr=None,
    fingerprint=KVFingerprint(
        model_id="sha256:aa",
        dtype="float32",
        block_size=16,
        layout="nbhd-v1",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
    ),
    max_model_len=512,
    num_blocks_total=64,
    num_blocks_free=60,
    num_blocks_cached=12,
    num_running=1,
    num_queued=3,
    num_queued_prefill_tokens=90,
    num_blocks_committed=16,
    heartbeat_time=100.0,
    step_stats={"prefill": {"steps": 4, "seconds": 0.5, "prompt_tokens": 800, "decode_tokens": 0}},
)
DECODE = dataclasses.replace(
    PREFILL,
    node_id="decode-b",
    role=Role.DECODE,
    control_addr="tcp://10.0.0.3:5002",
    kv_addr="tcp://10.0.0.3:5003",
    num_blocks_free=8,
    num_blocks_cached=0,
    num_running=7,
    num_queued=0,
    num_blocks_committed=None,
    draining=True,
    heartbeat_time=99.25,
    step_stats={
        "decode": {"steps": 200, "seconds": 7.1, "prompt_tokens": 0, "decode_tokens": 1400},
        "mixed": {"steps": 10, "seconds": 1.914, "prompt_tokens": 2100, "decode_tokens": 70},
    },
    speculation={"proposed_tokens": 1840, "accepted_tokens": 1141, "drafted_steps": 600},
)


def test_render_groups_nodes_by_role_with_blocks_queue_running_heartbeat_and_state():
    assert render([DECODE, PREFILL], now=101.0) == "\n".join(
        [
            "prefill: 1 node(s), 1 serving, KV blocks 60/64 free",
            "  NODE       ADDRESS              KV FREE/TOTAL  CACHED  COMMITTED  QUEUED  RUNNING  MEAN STEP      DRAFTS KEPT  HEARTBEAT  STATE",
            "  prefill-a  tcp://10.0.0.2:5001  60/64          12      25%        3       1        prefill 125ms  -            1.0s ago   serving",
            "",
            "decode: 1 node(s), 0 serving, KV blocks 8/64 free",
            "  NODE      ADDRESS              KV FREE/TOTAL  CACHED  COMMITTED  QUEUED  RUNNING  MEAN STEP                 DRAFTS KEPT  HEARTBEAT  STATE",
            "  decode-b  tcp://10.0.0.3:5002  8/64           0       -          0       7        decode 36ms, mixed 191ms  62% of 1840  1.8s ago   draining",
        ]
    )


def test_render_lists_colocated_nodes_in_their_own_pool():
    colocated = dataclasses.replace(DECODE, node_id="colocated-c", role="colocated", draining=False)
    lines = render([colocated], now=101.0).splitlines()
    assert lines[0] == "prefill: 0 node(s), 0 serving, KV blocks 0/0 free"
    assert "colocated: 1 node(s), 1 serving, KV blocks 8/64 free" in lines
    assert lines[-1].startswith("  colocated-c  tcp://10.0.0.3:5002")


def test_render_names_the_pools_with_an_int8_kv_cache():
    fp = KVFingerprint(
        model_id="sha256:aa",
        dtype="int8",
        block_size=16,
        layout="nbhd-q8-v1",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
    )
    int8 = dataclasses.replace(DECODE, fingerprint=fp)
    lines = render([PREFILL, int8], now=101.0).splitlines()
    assert lines[0] == "prefill: 1 node(s), 1 serving, KV blocks 60/64 free"
    assert "decode: 1 node(s), 0 serving, KV blocks 8/64 free (1 with int8 rows)" in lines


def test_render_says_so_when_no_node_is_registered():
    assert render([], now=0.0) == "no nodes registered"


@pytest.mark.usefixtures("processes")
def test_status_reads_the_nodes_registered_in_redis(tmp_path, capsys):
    redis = RedisServer(tmp_path)
    try:
        publish(redis.client, PREFILL, ttl_s=30)
        publish(redis.client, DECODE, ttl_s=30)
        assert main(["status", "--redis", redis.url]) == 0
    finally:
        redis.stop()
    out = capsys.readouterr().out
    assert out.index("prefill-a") < out.index("decode: 1 node(s), 0 serving") < out.index("decode-b")
    # The age is the clock's to say (a stepped wall clock makes it long): only its shape is checked.
    assert re.search(r"\d+\.\ds ago +draining", out), out


@pytest.mark.usefixtures("processes")
def test_status_with_the_cluster_key_lists_signed_records_and_says_which_it_refused(tmp_path, capsys):
    from pdserve.protocol.cluster_key import write_new_key

    key = write_new_key(tmp_path / "cluster.key")
    redis = RedisServer(tmp_path)
    try:
        publish(redis.client, PREFILL, ttl_s=30, key=key)
        publish(redis.client, DECODE, ttl_s=30)  # written by someone without the key
        assert (
            main(["status", "--redis", redis.url, "--cluster-key-file", str(tmp_path / "cluster.key")]) == 0
        )
        signed = capsys.readouterr().out
        assert main(["status", "--redis", redis.url]) == 0  # no key: every record, unchecked
        unchecked = capsys.readouterr().out
    finally:
        redis.stop()
    assert "prefill-a" in signed and "decode: 0 node(s)" in signed
    assert "refused: 1 record(s) not signed with the cluster key\n  pdserve:node:decode-b: unsigned" in signed
    assert "decode-b" in unchecked and "refused" not in unchecked
    assert main(["status", "--redis", redis.url, "--cluster-key-file", str(tmp_path / "none")]) == 1
    assert "cluster key file" in capsys.readouterr().err


def test_status_without_a_reachable_redis_fails_with_a_message(capsys):
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["status", "--redis", url]) == 1
    assert f"cannot read the registry at {url}" in capsys.readouterr().err


def test_status_takes_its_default_registry_from_pdserve_redis(monkeypatch):
    monkeypatch.setenv("PDSERVE_REDIS", "redis://elsewhere:6379/1")
    assert build_parser().parse_args(["status"]).redis == "redis://elsewhere:6379/1"
