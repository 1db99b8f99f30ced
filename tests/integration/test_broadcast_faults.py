"""Faults in the middle of a `broadcast` version (services/trainer/broadcast.py), ranks in
processes of their own (tests/fakes/broadcast_rank.py) SIGKILLed mid-stream:

- a receiver killed after its first bucket: the trainer's step does not fail (the broadcast is
  logged failed and its group dropped), the other receiver returns nothing partial, and the
  version is whole in the weight store for it (and for the killed one once back) to load;
- the trainer killed after its second bucket: no receiver returns the version (each says
  `Unavailable`: it loads from the store, where the version is whole or absent)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from asyncrl import fingerprint
from asyncrl.net import free_port
from asyncrl.spec import TrainerSpec
from services.rollout.broadcast_receiver import BroadcastReceiver, Unavailable
from services.trainer.broadcast import BroadcastSender
from services.trainer.transport import DiskSender, Store
from tests.cluster import ROOT
from tests.fakes.broadcast_rank import BUCKET_MB, Backend

pytestmark = pytest.mark.slow
EXP = "faults"


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
    tmp_path,
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
    assert got.startswith("unavailable"), got  # nothing partial reached the survivor
    assert sender.group is None  # dropped: the next version builds a group of the living
    stored = store.dir(1)
    assert fingerprint.read_manifest(stored) == sender.fingerprint(1)
    assert fingerprint.of_dir(stored) == sender.fingerprint(1)  # whole, for both to load


async def test_trainer_killed_mid_broadcast_no_receiver_returns_the_version(tmp_path):
    master = f"127.0.0.1:{free_port()}"
    trainer = _rank(tmp_path / "trainer.err", "trainer", master, EXP, "1", str(tmp_path / "w"), "2")
    receivers = [BroadcastReceiver() for _ in range(2)]
    try:
        fp = (await _line(trainer, "fingerprint")).split()[1]
        got = await asyncio.gather(*(_receive(r, master, i, 2) for i, r in enumerate(receivers, 1)))
        assert await _line(trainer, "killed after bucket 1")
    finally:
        trainer.kill()
        trainer.wait()
    assert all(isinstance(g, Unavailable) for g in got), got
    stored = tmp_path / "w" / EXP / "v000001"
    if stored.exists():  # written whole beside the stream, or not at all
        assert fingerprint.of_dir(stored) == fp
