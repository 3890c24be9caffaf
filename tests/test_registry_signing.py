"""Registry records under a cluster key (protocol/cluster_key.py), against a real redis-server: a
reader with the key takes a record only with a valid MAC over its key and every field."""

from __future__ import annotations

import dataclasses

import pytest
import redis

from protocol.cluster_key import ClusterKeyError, load_key, write_new_key
from protocol.registry import KEY_PREFIX, list_nodes, publish
from tests.cluster import RedisServer
from tests.test_router_support import node_info


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield redis.Redis.from_url(server.url)
    server.stop()


def test_only_records_signed_with_the_key_are_taken_and_each_refusal_is_said(client, tmp_path):
    client.flushdb()
    key, other = write_new_key(tmp_path / "k"), write_new_key(tmp_path / "other")
    publish(client, node_info("d1", "decode"), 30, key)
    publish(client, node_info("unsigned", "decode"), 30)
    publish(client, node_info("wrong-key", "decode"), 30, other)
    publish(client, node_info("moved", "decode"), 30, key)
    client.hset(KEY_PREFIX + "moved", "control_addr", '"tcp://10.9.9.9:5555"')  # where prompts would go
    copied = client.hgetall(KEY_PREFIX + "d1")  # a valid record, under another node's name
    client.hset(KEY_PREFIX + "impostor", mapping=copied)
    refused: list[str] = []
    assert [n.node_id for n in list_nodes(client, key, refused)] == ["d1"]
    assert sorted(refused) == [
        f"{KEY_PREFIX}impostor: bad MAC (another key, or a changed field)",
        f"{KEY_PREFIX}moved: bad MAC (another key, or a changed field)",
        f"{KEY_PREFIX}unsigned: unsigned",
        f"{KEY_PREFIX}wrong-key: bad MAC (another key, or a changed field)",
    ]
    # the record read back is the one published (the MAC field is not part of NodeInfo)
    (d1,) = list_nodes(client, key)
    assert dataclasses.replace(d1, heartbeat_time=0.0) == node_info("d1", "decode")
    # without a key (a loopback cluster of old), every readable record is taken
    assert len(list_nodes(client)) == 5


def test_a_key_file_is_checked_when_read(tmp_path):
    with pytest.raises(ClusterKeyError, match="missing.key"):
        load_key(tmp_path / "missing.key")
    (tmp_path / "short.key").write_text("abcd\n")
    with pytest.raises(ClusterKeyError, match="at least 32"):
        load_key(tmp_path / "short.key")
    made = write_new_key(tmp_path / "new.key")
    assert load_key(tmp_path / "new.key") == made and len(made) == 32
    assert (tmp_path / "new.key").stat().st_mode & 0o777 == 0o600
    (tmp_path / "raw.key").write_bytes(b"x" * 40)  # not hex: the bytes themselves
    assert load_key(tmp_path / "raw.key") == b"x" * 40


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "decode-0.example"])
def test_a_process_bound_beyond_loopback_refuses_to_start_without_the_key(host, tmp_path):
    from node.options import NodeOptions
    from protocol.registry import Role
    from router.config import RouterConfig

    with pytest.raises(ValueError, match="--cluster-key-file PATH"):
        NodeOptions(role=Role.DECODE, host=host, model_id="m")
    with pytest.raises(ValueError, match="the router binds .* beyond loopback"):
        RouterConfig(model="m", host=host, decode_addrs=("tcp://127.0.0.1:1",))
    write_new_key(tmp_path / "k")
    NodeOptions(role=Role.DECODE, host=host, model_id="m", cluster_key_file=str(tmp_path / "k"))
    RouterConfig(
        model="m", host=host, decode_addrs=("tcp://127.0.0.1:1",), cluster_key_file=str(tmp_path / "k")
    )
    for loopback in ("127.0.0.1", "localhost", "::1"):  # nothing changes for a newcomer
        NodeOptions(role=Role.DECODE, host=loopback, model_id="m")
        RouterConfig(model="m", host=loopback, decode_addrs=("tcp://127.0.0.1:1",))
