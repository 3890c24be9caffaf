"""launcher.ports: a free port is one the kernel will not hand to another socket meanwhile."""

from __future__ import annotations

import socket

from pdserve.launcher import ports


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    span = ports._below_ephemeral()
    assert span is not None, "this Linux publishes its ephemeral range"
    chosen = [ports.free_port() for _ in range(200)]
    assert len(set(chosen)) == len(chosen)
    assert all(p in span for p in chosen)
    # a port-0 bind (what ZeroMQ and every outgoing connection get) never lands on one of them
    low = int(ports._RANGE_FILE.read_text().split()[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= low


def test_a_port_someone_listens_on_is_not_chosen(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_below_ephemeral", lambda: range(taken, taken + 2))
        monkeypatch.setattr(ports, "_handed_out", set())
        assert ports.free_port() == taken + 1  # the listened-on port is skipped
        assert ports.free_port() not in (taken, taken + 1)  # both spent: the kernel's choice
