"""Network helpers shared by the services, the supervisor and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now (the OS picks it; a race with another binder is
    possible, so servers that can bind port 0 themselves should)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
