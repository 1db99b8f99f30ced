"""`asyncrl.collective.open_store`: the TCPStore a weight group meets on, hosted and reached
by the address the trainer commits (host:port, an IPv6 host bracketed)."""

from __future__ import annotations

import socket

import pytest

from asyncrl.collective import open_store


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]"])
def test_a_store_hosted_on_an_os_port_is_reached_by_its_address(host):
    if host.startswith("[") and not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    hosted = open_store(host, 0, master=True, timeout_s=5)
    assert hosted.port > 0
    address = f"{host}:{hosted.port}"  # as the trainer commits it
    reached_host, port = address.rsplit(":", 1)
    reached = open_store(reached_host, int(port), master=False, timeout_s=5)
    reached.set("v1/plan", "p")
    assert hosted.get("v1/plan") == b"p"
