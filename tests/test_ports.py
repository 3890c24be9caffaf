"""launcher.ports: a free port is one the kernel will not hand to another socket meanwhile."""

from __future__ import annotations

import socket

import pytest

from pdserve.launcher import ports


@pytest.fixture(autouse=True)
def no_configured_range(monkeypatch):
    """These tests are about the default span; tests/conftest.py may set one per xdist worker."""
    monkeypatch.delenv(ports.RANGE_ENV, raising=False)


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


def test_a_configured_range_is_kept_to_and_a_full_one_is_an_error(monkeypatch):
    low = ports.free_port()
    monkeypatch.setenv(ports.RANGE_ENV, f"{low}-{low + 2}")
    monkeypatch.setattr(ports, "_handed_out", set())
    chosen = {ports.free_port() for _ in range(3)}
    assert chosen == {low, low + 1, low + 2}
    with pytest.raises(OSError, match=ports.RANGE_ENV):  # never a port outside it
        ports.free_port()


@pytest.mark.parametrize("value", ["9000", "9000-", "b-9000", "9001-9000", "0-10", "65000-70000"])
def test_a_malformed_range_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ports.RANGE_ENV, value)
    with pytest.raises(ValueError, match=ports.RANGE_ENV):
        ports.free_port()
