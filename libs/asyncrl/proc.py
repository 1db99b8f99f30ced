"""Process lifetime helpers shared by the supervisor and the services.

`die_with_parent` is the kernel's side (PR_SET_PDEATHSIG, which psutil has no equivalent for);
the rest looks at and signals other processes through psutil.
"""

from __future__ import annotations

import os
import signal
import sys

import psutil


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


def pid_alive(pid: int | None) -> bool:
    """True if the process exists and is not a zombie (exited, waiting to be reaped)."""
    if not pid:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # it exists; we may not look at it


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to the process group led by `pid`, if there still is one."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL the process group of `pid` and every descendant, wherever its group is (found by
    parent pid, so also those that left the group: torchrun starts each rank in a new session)."""
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        below = []  # gone (or not ours to look at): its group may still hold stragglers
    signal_group(pid, signal.SIGKILL)
    for child in below:
        try:
            child.kill()  # psutil checks the pid still names the process it found
        except psutil.Error:
            pass
