"""The prefill node's shipper keeps a bounded table of decode peers that follows the cluster: idle
workers leave it (scaling and restarts bring new addresses forever), and a cancellation stops a
shipment queued or sending and is forgotten with its outcome. The decode addresses here have no receiver: each transfer ends in
a grant timeout, which is all these tests need from it."""

from __future__ import annotations

import time

import torch

from pdserve.kv_transfer.messages import KVShipment
from pdserve.kv_transfer.sender import SenderConfig
from pdserve.prefill_node.shipper import Shipment, Shipper
from tests.cluster import free_port
from tests.kv_transfer_peer import make_fingerprint


def _shipper(config: SenderConfig | None = None, **options) -> Shipper:
    caches = [torch.zeros(4, 4, 1, 8) for _ in range(2)]
    return Shipper(
        make_fingerprint(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8),
        caches,
        caches,
        config or SenderConfig(grant_timeout_s=0.3, shared_memory=False),
        **options,
    )


def _shipment(request_id: str, addr: str) -> Shipment:
    return Shipment(KVShipment(request_id, (1, 2, 3, 4, 5), (0, 1), 9, 0, None, None), addr)


def _outcomes(shipper: Shipper, num: int, timeout_s: float = 10.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < num:
        assert time.monotonic() < deadline, f"{len(got)} of {num} outcomes"
        got.append(shipper.outcomes.get(timeout=timeout_s))
    return got


def test_a_full_peer_table_makes_room_by_retiring_idle_peers():
    shipper = _shipper(max_peers=2)
    addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(5)]
    try:
        assert shipper.submit(_shipment("a", addrs[0])) and shipper.submit(_shipment("b", addrs[1]))
        assert not shipper.submit(_shipment("c", addrs[2]))  # both peers busy: refused, not queued
        assert {o.request_id for o in _outcomes(shipper, 2)} == {"a", "b"}
        time.sleep(0.1)  # the workers mark themselves idle
        for i, addr in enumerate(addrs[2:]):  # three new addresses through a table of two
            assert shipper.submit(_shipment(f"n{i}", addr)), addr
            assert _outcomes(shipper, 1)[0].request_id == f"n{i}"
            time.sleep(0.1)
        assert shipper.num_peers <= 2
    finally:
        shipper.close()


def test_idle_workers_leave_the_table():
    shipper = _shipper(idle_timeout_s=0.2)
    try:
        assert shipper.submit(_shipment("a", f"tcp://127.0.0.1:{free_port()}"))
        _outcomes(shipper, 1)
        deadline = time.monotonic() + 5
        while shipper.num_peers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert shipper.num_peers == 0
    finally:
        shipper.close()


def test_a_cancelled_shipment_stops_queued_or_sending_and_is_then_forgotten():
    """Queued: skipped. Sending (here: waiting for a grant that would take its 5 s deadline):
    stopped within a fraction of a second. Both report an outcome, and no flag outlives it."""
    shipper = _shipper(config=SenderConfig(grant_timeout_s=5.0, shared_memory=False))
    addr = f"tcp://127.0.0.1:{free_port()}"
    try:
        assert shipper.submit(_shipment("running", addr)) and shipper.submit(_shipment("queued", addr))
        deadline = time.monotonic() + 5  # until a worker took "running" (it waits for its grant)
        while shipper.outcomes.empty() and time.monotonic() < deadline:
            time.sleep(0.05)
            if any(p.busy for p in shipper._peers.values()):
                break
        started = time.monotonic()
        shipper.cancel("running")
        shipper.cancel("queued")
        shipper.cancel("unknown")
        outcomes = {o.request_id: o for o in _outcomes(shipper, 2)}
        assert time.monotonic() - started < 1.0
        assert outcomes["queued"].error == "aborted"
        assert "KVAborted" in outcomes["running"].error and not outcomes["running"].rejected
        assert not shipper._cancels
    finally:
        shipper.close()
