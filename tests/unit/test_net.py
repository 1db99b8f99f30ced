"""asyncrl.net.free_port: below the kernel's ephemeral range, where no connect takes it."""

from __future__ import annotations

import socket

from asyncrl import net


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        return True


def test_free_port_is_below_the_ephemeral_range_and_free():
    low = net._ephemeral_low()
    ports = {net.free_port() for _ in range(20)}
    assert all(net.LOWEST <= p < low for p in ports), (sorted(ports), low)
    assert all(_bindable(p) for p in ports)
    assert len(ports) > 1  # picked at random, not the same one each time


def test_free_port_skips_a_port_in_use(monkeypatch):
    """The first pick is a port another socket listens on: the next pick is returned."""
    real = net.secrets.randbelow
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        picks = iter([taken - net.LOWEST])
        monkeypatch.setattr(net.secrets, "randbelow", lambda n: next(picks, None) or real(n))
        port = net.free_port()
    assert port != taken and net.LOWEST <= port < net._ephemeral_low()


def test_free_port_without_room_below_the_range_lets_the_os_pick(monkeypatch):
    monkeypatch.setattr(net, "_ephemeral_low", lambda: net.LOWEST + 10)
    assert _bindable(net.free_port())
