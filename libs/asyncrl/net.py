"""Network helpers shared by the services, the supervisor and the tests."""

from __future__ import annotations

import re
import secrets
import socket
from pathlib import Path

from asyncrl.errors import BadRequest

LOWEST = 10000
"""The lowest port `free_port` picks."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now, for a server that is told its port rather than binding
    port 0 itself (a race with another binder is still possible: such a server should be
    started again on another port when its bind fails).

    Picked at random below the kernel's ephemeral range. Above it, every outgoing connection
    takes its local port, and the OS's own port-0 binds land there too: a port released there
    is soon taken by another process's connect (the suite's two workers: a store's bind failed
    with EADDRINUSE, 2026-11-27). Below it, only another caller of this function competes."""
    room = _ephemeral_low() - LOWEST
    for _ in range(64 if room > 1000 else 0):
        port = LOWEST + secrets.randbelow(room)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range, or all of it taken: the OS picks
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]{1,253}):([0-9]{1,5})")
"""A service's address: host (a name, IPv4, or [IPv6]) and port."""


def check_address(field: str, address: str) -> None:
    """BadRequest naming `field` unless `address` is host:port (`ADDRESS`, port 1-65535)."""
    match = ADDRESS.fullmatch(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise BadRequest(field, f"{address[:100]!r} is not host:port (port 1-65535)")
