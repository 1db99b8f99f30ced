"""Process lifetime helpers shared by the supervisor and the services."""

from __future__ import annotations

import os
import signal
import sys


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies (PR_SET_PDEATHSIG,
    which survives exec), so nothing is left orphaned. If the parent died while this was being
    set up, deliver `sig` now. A no-op elsewhere. Usable as a Popen preexec_fn. (The parent may
    legitimately be PID 1, e.g. torchrun as a container's entry point: compare, don't assume.)"""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
