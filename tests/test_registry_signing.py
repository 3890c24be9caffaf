"""Registry records under a cluster key (protocol/cluster_key.py), against a real redis-server: a
reader with the key takes a record only with a valid MAC over its key and every field."""

from __future__ import annotations

import dataclasses
import re
import time

import pytest
import redis

from pdserve.protocol.cluster_key import ClusterKeyError, load_key, write_new_key
from pdserve.protocol.registry import KEY_PREFIX, list_nodes, publish
from tests.cluster import RedisServer
from tests.test_router_support import node_info


@pytest.fixture(scope="module")
def client(tmp_path_factory, processes):
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
    from pdserve.node.options import NodeOptions
    from pdserve.protocol.registry import Role
    from pdserve.router.config import RouterConfig

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


def test_a_signed_record_written_back_later_is_refused_as_a_replay(client, tmp_path, caplog):
    """A writer with Redis access but no key captures valid records and writes them back: over a
    live node's newer one, and after the node left. The router's registry refuses both and says
    why; the live node keeps its newest record meanwhile, and the node that left stays gone."""
    import asyncio

    from pdserve.router.node_client import NodeClient
    from pdserve.router.registry_client import RedisRegistry

    client.flushdb()
    key_file = tmp_path / "k"
    key = write_new_key(key_file)
    url = client.connection_pool.connection_kwargs
    redis_url = f"redis://{url['host']}:{url['port']}/0"

    async def go():
        nodes = NodeClient()
        registry = RedisRegistry(redis_url, nodes, 0.1, 30.0, key)
        caplog.set_level("WARNING", logger="pdserve.router.registry_client")

        def refused() -> list[str]:
            return [r.getMessage() for r in caplog.records if "refused node record" in r.getMessage()]

        try:
            publish(client, node_info("d1", "decode"), 30, key)
            publish(client, node_info("gone", "decode"), 30, key)
            captured = {name: client.hgetall(KEY_PREFIX + name) for name in ("d1", "gone")}
            assert [n.node_id for n in await registry.poll_once()] == ["d1", "gone"]
            await asyncio.sleep(0.01)
            publish(client, node_info("d1", "decode"), 30, key)  # the next heartbeat
            client.delete(KEY_PREFIX + "gone")  # that node drained
            assert [n.node_id for n in await registry.poll_once()] == ["d1"]
            for name, record in captured.items():
                client.hset(KEY_PREFIX + name, mapping=record)
            (kept,) = await registry.poll_once()  # the live node keeps its newest record; gone stays gone
            assert kept.node_id == "d1" and kept.heartbeat_time > float(captured["d1"][b"heartbeat_time"])
            assert len(refused()) == 2
            d1, gone = sorted(m.split("record ", 1)[1] for m in refused())
            assert re.fullmatch(
                rf"{KEY_PREFIX}d1: replayed: its heartbeat is 0\.\d+s older than one seen before", d1
            )
            assert (
                gone
                == f"{KEY_PREFIX}gone: replayed: the node's last record, written back after its key had gone"
            )
            publish(client, node_info("d1", "decode"), 30, key)  # the live node beats again
            assert [n.node_id for n in await registry.poll_once()] == ["d1"]
            # a router that starts later has seen neither node: a capture older than its skew
            # allowance is refused by age, a fresh record taken
            await asyncio.sleep(0.6)
            publish(client, node_info("d1", "decode"), 30, key)
            client.hset(KEY_PREFIX + "gone", mapping=captured["gone"])
            late = RedisRegistry(redis_url, nodes, 0.1, 30.0, key, max_record_skew_s=0.5)
            assert [n.node_id for n in await late.poll_once()] == ["d1"]
            assert f"{KEY_PREFIX}gone: replayed or stale: its heartbeat is" in refused()[-1]
        finally:
            await nodes.close()

    asyncio.run(go())


def test_a_live_nodes_heartbeat_stamps_never_go_back_even_when_the_wall_clock_does(monkeypatch):
    from pdserve.protocol import registry

    first = registry.heartbeat_clock()
    monkeypatch.setattr(registry, "_wall_clock", lambda: 0.0)  # an NTP step back to 1970
    assert registry.heartbeat_clock() >= first
    time.sleep(0.05)
    assert registry.heartbeat_clock() >= first + 0.05  # and go on at the monotonic clock's pace


def test_heartbeat_stamps_follow_the_wall_clock_forward_after_a_pause(monkeypatch):
    """A VM paused and resumed: its wall clock steps ahead of where the monotonic clock took the
    stamps (CI saw 21.8 s). Stamps from the old time would make a router started after the step
    refuse the node's records as stale captures (ReplayGuard's skew allowance, 60 s)."""
    from pdserve.protocol import registry

    before = registry.heartbeat_clock()
    stepped = time.time() + 600.0
    monkeypatch.setattr(registry, "_wall_clock", lambda: stepped)
    after = registry.heartbeat_clock()
    assert after == stepped and after - before > 599.0
    guard = registry.ReplayGuard(60.0)  # a router started after the step, its clock at `stepped`
    node = node_info("d1", "decode", heartbeat_time=after)
    assert guard.check(node, stepped + 1.0, listed_before=False) is None
    stale = node_info("d2", "decode", heartbeat_time=before)  # as the old clock would have stamped
    assert "behind this clock" in guard.check(stale, stepped + 1.0, listed_before=False)
