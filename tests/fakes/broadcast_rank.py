"""One rank of a `broadcast` weight group in a process of its own, for the fault tests
(tests/integration/test_broadcast_faults.py), which SIGKILL it mid-broadcast:

  python -m tests.fakes.broadcast_rank receiver|stalls MASTER EXP VERSION RANK N
      receives the version and prints `received <fingerprint>` or `unavailable <why>`; `stalls`
      prints `bucket 0` once its first bucket is in, and stalls there.
  python -m tests.fakes.broadcast_rank trainer MASTER EXP VERSION STORE_DIR N_ENGINES
      streams a version of `state()` (random, seeded) to N_ENGINES rollouts; its group kills
      this process after its second bucket (`os._exit` inside the broadcast); handing the
      version over through shared memory, it prints `handed over` once the plan names its
      files and stalls there (the test kills it while the receivers copy).
  python -m tests.fakes.broadcast_rank both MASTER EXP VERSION STORE_DIR 2
      the trainer and 2 receivers in this process, each receiving in a thread: prints one
      JSON line, what the trainer logged (event names), how it sent (`via`), its fingerprint
      and what each receiver returned (tests/integration/test_broadcast_shm_full.py runs it
      with a /dev/shm too small for the buckets).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import structlog
import torch

BUCKET_MB = 4


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(1024, 1024, generator=gen) for i in range(8)}  # 8 x 4 MiB


class Backend:
    steps = 1

    def hf_state(self):
        return state(), b"{}"


def receiver(master: str, exp: str, version: int, rank: int, n: int, stalls: bool) -> None:
    from services.rollout.broadcast_receiver import BroadcastReceiver, Unavailable

    r = BroadcastReceiver()

    def stall(i: int, buf) -> None:
        if i == 0:
            print("bucket 0", flush=True)
            time.sleep(600)

    r.corrupt = stall if stalls else None
    try:
        got = r.receive(exp, master, version, rank, n, 60.0)
    except Unavailable as exc:
        print(f"unavailable {exc}", flush=True)
    else:
        print(f"received {got.fingerprint}", flush=True)


async def trainer(master: str, exp: str, version: int, store_dir: str, n: int) -> None:
    from asyncrl import collective
    from asyncrl.spec import TrainerSpec
    from services.trainer.broadcast import BroadcastSender
    from services.trainer.transport import DiskSender, Store

    sent = collective.Group.broadcast

    def dies_after_two(self, tensor, src=0):
        sent(self, tensor, src)
        dies_after_two.n = getattr(dies_after_two, "n", 0) + 1
        if dies_after_two.n == 2:
            print("killed after bucket 1", flush=True)
            os._exit(9)

    def stalls_after_the_plan(self, version, world, nbytes):
        print("handed over", flush=True)
        time.sleep(600)

    collective.Group.broadcast = dies_after_two
    BroadcastSender._copied = stalls_after_the_plan
    spec = TrainerSpec(weight_sync="broadcast", nccl_master=master, broadcast_bucket_mb=BUCKET_MB)
    tok = Path(store_dir) / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    store = Store(root=Path(store_dir), experiment_id=exp, tokenizer_dir=tok, keep=2)
    sender = BroadcastSender(DiskSender(store), spec, structlog.get_logger(), 20.0)
    snap = sender.snapshot(Backend())
    await sender.publish(version, snap)
    print(f"fingerprint {sender.fingerprint(version)}", flush=True)
    await sender.send(version, asyncio.sleep(0))


class Events:
    """A structlog stand-in that keeps the event names and the last `broadcast_sent`."""

    def __init__(self):
        self.events, self.sent = [], {}

    def info(self, event: str, **fields) -> None:
        self.events.append(event)
        if event == "broadcast_sent":
            self.sent = fields

    warning = info


async def both(master: str, exp: str, version: int, store_dir: str, n: int) -> None:
    import json

    from asyncrl.spec import TrainerSpec
    from services.rollout.broadcast_receiver import BroadcastReceiver
    from services.trainer.broadcast import BroadcastSender
    from services.trainer.transport import DiskSender, Store

    spec = TrainerSpec(weight_sync="broadcast", nccl_master=master, broadcast_bucket_mb=BUCKET_MB)
    tok = Path(store_dir) / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    store = Store(root=Path(store_dir), experiment_id=exp, tokenizer_dir=tok, keep=2)
    log = Events()
    sender = BroadcastSender(DiskSender(store), spec, log, 20.0)
    snap = sender.snapshot(Backend())
    await sender.publish(version, snap)
    receivers = [BroadcastReceiver() for _ in range(n)]

    async def commit():
        return await asyncio.gather(
            *(
                asyncio.to_thread(r.receive, exp, master, version, rank, n, 20.0)
                for rank, r in enumerate(receivers, 1)
            )
        )

    got = await sender.send(version, commit())
    await sender.close()
    out = {"events": log.events, "via": log.sent.get("via"), "fingerprint": sender.fingerprint(1)}
    print(json.dumps(out | {"received": [g.fingerprint for g in got]}), flush=True)


if __name__ == "__main__":
    role, master, exp, version, *rest = sys.argv[1:]
    if role == "both":
        asyncio.run(both(master, exp, int(version), rest[0], int(rest[1])))
    elif role in ("receiver", "stalls"):
        receiver(master, exp, int(version), int(rest[0]), int(rest[1]), role == "stalls")
    else:
        asyncio.run(trainer(master, exp, int(version), rest[0], int(rest[1])))
