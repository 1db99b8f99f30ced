"""A trained version into every engine, per transport, against the machine's bound.

For the demo model's shape (`asyncrl.tiny`, the arith demo's) and SmolLM2-135M's (random fp32
weights, bench/gpu/shapes.py; --quick: the demo's alone): a real torch trainer backend holds
the model; after a "step" (every parameter nudged in place, the optimizer's work left out) the
version goes to two real torch engines loaded with the base (idle: the transport alone is
measured; one trainer and two engines in this process, each blocking call in its own thread,
as the services run them):

- `disk`: the trainer serialises the version (`hf_files`: its stall), writes it to the weight
  store, and both engines read it from there, hash it and swap it in (UpdateWeights).
- `broadcast shm` (the default where the engines run on the trainer's host): the trainer packs
  its parameters into buckets that are files in /dev/shm (`BroadcastSender.snapshot`: its
  stall) and checksums them; each engine copies the buckets out into a staging set, checks
  the checksums of its copy and takes that set's tensors as its weights (services/trainer/
  broadcast.py, `asyncrl.shm`); then the store copy is written from the same buffers.
- `broadcast`: the same buckets streamed over a gloo group on loopback into the staging sets
  instead (ASYNCRL_BROADCAST_SHM=0: how a version reaches engines on other hosts).
- `broadcast+delta`: that for a version that follows one both engines took by broadcast,
  sent as its delta (`trainer.broadcast_delta`: per bucket the 4-byte words that changed,
  encoded after the checksums). Its stand-in step changes one element in `SPARSE` of every
  parameter (fp32 here: one word each) instead of all of them, a sparse update like a bf16
  step's (most bf16 weights stay bit-identical between steps); the row says the fraction of
  words that changed and the bytes sent against the full version's.

Per transport: `train end -> both serving` (seconds from the nudge to the last engine serving
the version) against the bound: a memcpy of the bytes the version moves into the engines (2 x
its bytes), measured in the same run; the trainer's stall against the same bound; and, for disk,
a `cp` of the version's safetensors file beside it. Settings carry the bytes moved, the phases
and the time until the store copy is written. NATS is measured by bench `weight_transfer`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import structlog
import torch

from asyncrl.net import free_port
from asyncrl.spec import ExperimentSpec
from asyncrl.tiny import build_tiny_model
from bench.gpu.shapes import build
from bench.report import Context, Result
from services.rollout.broadcast_receiver import BroadcastReceiver
from services.rollout.torch_engine import TorchEngine
from services.trainer.backends.torch_backend import TorchBackend
from services.trainer.broadcast import BroadcastSender
from services.trainer.transport import DiskSender, Store

NAME = "weights"
EXP = "bench"
ENGINES = 2
SPARSE = 100
"""The delta row's stand-in step changes every SPARSE-th element of each parameter."""
TRANSPORTS = ("disk", "broadcast shm", "broadcast", "broadcast+delta")
KINDS = {
    "broadcast shm": (False, True),
    "broadcast": (False, False),
    "broadcast+delta": (True, False),
}
"""A broadcast transport's (delta, shm) for `_broadcast`."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memcpy_s(nbytes: int, device="cpu", repeats: int = 3) -> float:
    """The best of `repeats` copies of `nbytes` between two warm buffers on `device` (on a
    GPU: a device-to-device copy)."""
    device = torch.device(device)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _cp_s(path: Path, repeats: int = 3) -> float:
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        shutil.copyfile(path, path.with_name(f"copy-{i}"))
        best = min(best, time.perf_counter() - t0)
        path.with_name(f"copy-{i}").unlink()
    return best


class Rig:
    """The trainer backend, the store and two engines of one model shape."""

    def __init__(self, model_dir: Path, work: Path, device="cpu"):
        self.model_dir, self.work, self.device = model_dir, work, torch.device(device)
        self.spec = ExperimentSpec(
            model={"path": str(model_dir)},
            dataset={"path": "unused.jsonl"},
            trainer={
                "backend": "torch",
                "weight_sync": "broadcast",
                "nccl_master": f"127.0.0.1:{free_port()}",
            },
        )
        self.store = Store(root=work / "store", experiment_id=EXP, tokenizer_dir=model_dir, keep=2)
        self.backend = TorchBackend(self.spec, device=str(self.device))
        self.engines = [
            TorchEngine(device=str(self.device), seed=i, max_batch=4) for i in range(ENGINES)
        ]
        self.version = 0

    async def start(self) -> None:
        await asyncio.to_thread(self.backend.load, str(self.model_dir))
        for e in self.engines:
            await e.start()
            await e.load(str(self.model_dir), 0)

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()

    def step(self, every: int = 1) -> float:
        """A stand-in step (every `every`-th element of every parameter nudged; 1: all of
        them); when it ended."""
        with torch.no_grad():
            for p in self.backend.model.parameters():
                p.view(-1)[::every].add_(1e-3)
        self.version += 1
        _sync(self.device)
        return time.perf_counter()

    @property
    def nbytes(self) -> int:
        state, _ = self.backend.hf_state()
        return sum(t.numel() * t.element_size() for t in state.values())


async def _disk(rig: Rig) -> dict:
    ended = rig.step()
    files = await asyncio.to_thread(rig.backend.hf_files)
    stall = time.perf_counter() - ended
    await asyncio.to_thread(rig.store.write, rig.version, files)
    written = time.perf_counter() - ended
    path = str(rig.store.dir(rig.version))
    await asyncio.gather(*(e.update_weights(path, rig.version) for e in rig.engines))
    return {"serving_s": time.perf_counter() - ended, "stall_s": stall, "stored_s": written}


async def _broadcast(rig: Rig, sender: BroadcastSender, receivers, delta: bool, shm: bool) -> dict:
    """A version handed over through shared memory (`shm`) or streamed over the socket, whole
    or (`delta`) a sparse one sent as its delta."""
    sender.delta = delta
    os.environ["ASYNCRL_BROADCAST_SHM"] = "1" if shm else "0"
    ended = rig.step(SPARSE if delta else 1)
    snap = await asyncio.to_thread(sender.snapshot, rig.backend)
    stall = time.perf_counter() - ended
    v, master = rig.version, rig.spec.trainer.nccl_master
    uri = await sender.publish(v, snap)
    served: list[float] = []

    received, applied = [], []

    async def one(rank: int):
        got = await asyncio.to_thread(receivers[rank - 1].receive, EXP, master, v, rank, 2, 60.0)
        engine = rig.engines[rank - 1]
        await engine.apply_state(uri, v, got.state, got.fingerprint, got.seconds)
        assert engine.fingerprint == sender.fingerprint(v)
        served.append(time.perf_counter())
        received.append(got.seconds)
        applied.append(engine.last_update.load_s)

    async def commit():
        await asyncio.gather(*(one(r) for r in range(1, ENGINES + 1)))

    await sender.send(v, commit())
    sent, full = sender.moved(v)
    return {
        "serving_s": max(served) - ended,
        "stall_s": stall,
        "stored_s": time.perf_counter() - ended,
        **{k: v for k, v in sender.last.items() if k.endswith("_s")},
        "receive_s": max(received),  # hello to checked, the slower engine
        "apply_s": max(applied),  # into the model, paused
        "sent_mib": sent / (1 << 20),
        "full_mib": full / (1 << 20),
        **{k: v for k, v in sender.last.items() if k == "changed"},  # encoded: words changed
    }


async def measure(model_dir: Path, work: Path, repeats: int, device="cpu", transports=TRANSPORTS):
    """Each transport's best run of `repeats` (after a warm-up: buffers, the group), the
    version's bytes and the bounds measured beside them (memcpy of the bytes into the engines
    on `device`; `cp` of the version's file)."""
    rig = Rig(model_dir, work, device)
    await rig.start()
    sender = BroadcastSender(DiskSender(rig.store), rig.spec.trainer, structlog.get_logger(), 60)
    receivers = [BroadcastReceiver(rig.device) for _ in rig.engines]
    runs: dict[str, list[dict]] = {t: [] for t in transports}
    try:
        for _ in range(repeats + 1):
            for transport in transports:
                if transport == "disk":
                    for r in receivers:  # as a rollout does: the engines serve from staging
                        r.staging.forget()
                    runs["disk"].append(await _disk(rig))
                else:
                    got = await _broadcast(rig, sender, receivers, *KINDS[transport])
                    runs[transport].append(got)
        nbytes = rig.nbytes
        bounds = {"memcpy": _memcpy_s(ENGINES * nbytes, rig.device)}
        bounds["cp"] = _cp_s(rig.store.dir(rig.version) / "model.safetensors")
    finally:
        os.environ.pop("ASYNCRL_BROADCAST_SHM", None)
        await sender.close()
        await rig.stop()
    best = {t: min(rows[1:], key=lambda r: r["serving_s"]) for t, rows in runs.items()}
    return best, nbytes, bounds


async def _shape(ctx: Context, label: str, model_dir: Path, repeats: int) -> list[Result]:
    best, nbytes, bounds = await measure(model_dir, ctx.work_dir / f"weights-{label}", repeats)
    out = []
    for transport, row in best.items():
        out += _rows(label, transport, row, nbytes, bounds, repeats)
    return out


def _rows(label, transport, best: dict, nbytes: int, bounds: dict, repeats: int) -> list:
    """One transport's results: train end -> serving and the stall against the memcpy bound;
    disk's also against `cp`, a delta's MiB sent against the full version's (its settings say
    the fraction of words that changed: `changed`)."""
    mib = nbytes / (1 << 20)
    settings = {
        "model": label,
        "version_mib": round(mib, 1),
        "mib_moved": round(best.get("sent_mib", mib) * ENGINES + mib, 1),  # engines + store
        "engines": ENGINES,
        **{k: round(v, 6 if k == "changed" else 4) for k, v in best.items()},
        "repeats": repeats,
    }
    memcpy, head = f"memcpy of {ENGINES} x {mib:.1f} MiB", f"{label} {transport}"
    serving = f"{head}: train end -> {ENGINES} engines serving (s)"
    out = [
        Result(NAME, serving, best["serving_s"], "s", memcpy, bounds["memcpy"], settings),
        Result(
            NAME,
            f"{head}: trainer stall (s)",
            best["stall_s"],
            "s",
            memcpy,
            bounds["memcpy"],
            settings,
        ),
    ]
    if transport == "disk":
        cp = f"cp of the {mib:.1f} MiB file"
        out.append(
            Result(NAME, f"{serving} vs cp", best["serving_s"], "s", cp, bounds["cp"], settings)
        )
    if transport == "broadcast+delta":
        what, full = f"{head}: MiB sent per engine", "the full version's buckets"
        out.append(Result(NAME, what, best["sent_mib"], "MiB", full, best["full_mib"], settings))
    return out


def run(ctx: Context) -> list[Result]:
    demo = ctx.work_dir / "weights-demo-model"
    build_tiny_model(demo)  # the arith demo's shape (examples/arith/build.py)
    repeats = ctx.size(3, 1)
    results = asyncio.run(_shape(ctx, "demo", demo, repeats))
    if not ctx.quick:  # a smoke run needs every transport, not the second shape
        smol = build("smollm2-135m", ctx.work_dir / "weights-smollm2-model")
        results += asyncio.run(_shape(ctx, "smollm2-135m", smol, repeats))
    return results
