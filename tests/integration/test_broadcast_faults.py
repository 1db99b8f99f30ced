"""Faults in the middle of a `broadcast` version (services/trainer/broadcast.py), ranks in
processes of their own (tests/fakes/broadcast_rank.py) SIGKILLed mid-stream, over gloo
(ASYNCRL_BROADCAST_SHM=0, as between hosts) and through shared memory (the same-host default):

- a receiver killed after its first bucket: the trainer's step does not fail, and the version
  is whole in the weight store for the killed one once back (and, over gloo, for the other:
  the group fails, the broadcast is logged failed and dropped, and the other returns nothing
  partial; through shared memory the other copies the version out whole and serves it);
- the trainer killed mid-version (over gloo after its second bucket: no receiver returns the
  version, each says `Unavailable` and loads from the store, once a trainer writes it there;
  through shared memory while the receivers copy out of the files the plan names, sealed
  before: each receiver returns the version whole, and the next trainer of the host removes
  the files)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import structlog

from asyncrl import fingerprint, shm
from asyncrl.net import free_port
from asyncrl.spec import TrainerSpec
from services.rollout.broadcast_receiver import BroadcastReceiver, Unavailable
from services.trainer.broadcast import BroadcastSender
from services.trainer.transport import DiskSender, Store
from tests.cluster import ROOT
from tests.fakes.broadcast_rank import BUCKET_MB, Backend

pytestmark = pytest.mark.slow
EXP = "faults"


@pytest.fixture(params=["gloo", "shm"])
def via(request, monkeypatch) -> str:
    monkeypatch.setenv("ASYNCRL_BROADCAST_SHM", "1" if request.param == "shm" else "0")
    return request.param


def _rank(stderr: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.broadcast_rank", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=stderr.open("w"),
        text=True,
    )


async def _line(proc: subprocess.Popen, starts, timeout: float = 60.0) -> str:
    """The first line of `proc`'s output that starts with `starts` (a prefix or a tuple)."""
    seen = []

    async def read():
        while True:
            line = await asyncio.to_thread(proc.stdout.readline)
            assert line, f"{proc.args} exited ({proc.wait()}) before {starts!r}: {seen[-3:]}"
            if line.startswith(starts):
                return line.strip()
            seen.append(line.strip()[:300])

    return await asyncio.wait_for(read(), timeout)


async def _receive(receiver, master: str, rank: int, n: int):
    try:
        return await asyncio.to_thread(receiver.receive, EXP, master, 1, rank, n, 60.0)
    except Unavailable as exc:
        return exc


async def test_receiver_killed_mid_broadcast_the_step_goes_on_and_the_store_has_the_version(
    tmp_path, via
):
    master = f"127.0.0.1:{free_port()}"
    spec = TrainerSpec(weight_sync="broadcast", nccl_master=master, broadcast_bucket_mb=BUCKET_MB)
    (tmp_path / "tok").mkdir()
    store = Store(root=tmp_path / "w", experiment_id=EXP, tokenizer_dir=tmp_path / "tok", keep=2)
    sender = BroadcastSender(DiskSender(store), spec, structlog.get_logger(), 90.0)  # slow starts
    snap = await asyncio.to_thread(sender.snapshot, Backend())
    await sender.publish(1, snap)
    victim = _rank(tmp_path / "victim.err", "stalls", master, EXP, "1", "2", "2")
    survivor = _rank(tmp_path / "survivor.err", "receiver", master, EXP, "1", "1", "2")

    async def commit():
        await _line(victim, "bucket 0")
        victim.kill()
        return await _line(survivor, ("received", "unavailable"), timeout=120)

    try:
        got = await sender.send(1, commit())  # does not raise: the store copy is the way back
    finally:
        for rank in (victim, survivor):
            rank.kill()
            rank.wait()
        await sender.close()
    if via == "gloo":
        assert got.startswith("unavailable"), got  # nothing partial reached the survivor
        assert sender.group is None  # dropped: the next version builds a group of the living
    else:  # the survivor's copy does not depend on the victim's
        assert got == f"received {sender.fingerprint(1)}", got
    stored = store.dir(1)
    assert fingerprint.read_manifest(stored) == sender.fingerprint(1)
    assert fingerprint.of_dir(stored) == sender.fingerprint(1)  # whole, for both to load


async def test_trainer_killed_mid_broadcast_no_receiver_returns_a_partial_version(tmp_path, via):
    master = f"127.0.0.1:{free_port()}"
    trainer = _rank(tmp_path / "trainer.err", "trainer", master, EXP, "1", str(tmp_path / "w"), "2")
    receivers = [BroadcastReceiver() for _ in range(2)]

    both_copying = threading.Barrier(2, timeout=60)

    def kill_the_trainer(i: int, buf) -> None:  # shm: mid-copy (gloo: it kills itself)
        if via == "shm" and i == 0 and both_copying.wait() == 0:  # once both read the plan
            trainer.kill()
            trainer.wait()

    for r in receivers:
        r.corrupt = kill_the_trainer
    try:
        fp = (await _line(trainer, "fingerprint")).split()[1]
        got = await asyncio.gather(*(_receive(r, master, i, 2) for i, r in enumerate(receivers, 1)))
        assert trainer.wait(timeout=60) != 0
    finally:
        trainer.kill()
        trainer.wait()
    if via == "gloo":
        assert all(isinstance(g, Unavailable) for g in got), got
    else:  # sealed before the plan named the files, which outlive the trainer: whole, checked
        assert [getattr(g, "fingerprint", repr(g)) for g in got] == [fp, fp]
        files = shm.owned_by(trainer.pid)
        assert any(f.startswith(files) for f in os.listdir(shm.ROOT))
        shm.sweep()  # what the next trainer on the host does first
        assert not any(f.startswith(files) for f in os.listdir(shm.ROOT))
    stored = tmp_path / "w" / EXP / "v000001"
    assert not stored.exists()  # written after the broadcast, which did not end
