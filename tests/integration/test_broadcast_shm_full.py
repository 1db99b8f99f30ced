"""A /dev/shm too small for a version's buckets (a container's 64 MiB default against a larger
model): the trainer falls back to ordinary buffers and the socket, logs `broadcast_shm_full`,
and the version arrives whole; no SIGBUS. Run for real: the trainer and two receivers in a
process of their own, in a mount namespace whose /dev/shm is a 1 MiB tmpfs (the version is
32 MiB; tests/fakes/broadcast_rank.py `both`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from asyncrl.net import free_port
from tests.cluster import ROOT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("unshare"),
        reason="a mount namespace of its own needs root and unshare",
    ),
]


def _both(tmp_path, shm_size: str) -> dict:
    rank = f"{sys.executable} -m tests.fakes.broadcast_rank"
    args = f"both 127.0.0.1:{free_port()} full 1 {tmp_path / 'w'} 2"
    script = f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm && exec {rank} {args}"
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_full_dev_shm_means_the_socket_not_a_sigbus(tmp_path):
    got = _both(tmp_path, "1m")
    assert "broadcast_shm_full" in got["events"]
    assert got["via"] == "gloo"
    assert got["received"] == [got["fingerprint"]] * 2


def test_with_room_the_same_version_goes_through_dev_shm(tmp_path):
    got = _both(tmp_path, "256m")  # two sets of 32 MiB
    assert "broadcast_shm_full" not in got["events"]
    assert got["via"] == "shm"
    assert got["received"] == [got["fingerprint"]] * 2
