"""Weight transfer without a shared filesystem: a version through the NATS object store against
a plain file copy of the same bytes on one host.

A version directory (a generated safetensors file of random float tensors, 256 MiB, 64 MiB
with --quick, plus a config.json) goes the way ASYNCRL_WEIGHTS_TRANSPORT=nats sends it: the
trainer's `upload_version` into a secure nats-server (TLS, its own user, as `make up` runs it),
a rollout's `fetch_version` into a cache directory (ordered consumer, each chunk written as it
arrives, SHA-256 checked). Peers, measured in the same run on the same files:

- `shutil.copyfile` of the version's files into another directory (what a shared filesystem
  costs at best: one host, page cache);
- nats-py's `ObjectStore.get()` of the safetensors object (the whole object gathered in
  memory; quadratic in the number of chunks, see asyncrl.weights_nats).

Ratio = MiB/s ÷ the peer's MiB/s.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.natsutil import LocalNatsServer, connect
from asyncrl.weights_nats import (
    CHUNK_SIZE,
    WEIGHTS_BUCKET,
    fetch_version,
    upload_version,
    version_prefix,
)
from bench.report import Context, Result

NAME = "weight_transfer"
EXP = "bench"
MIB = 1 << 20


def _version(root: Path, mib: int) -> Path:
    """A version directory of `mib` MiB of bf16 tensors (16 MiB each) and a config."""
    d = root / "weights" / EXP / "v000001"
    d.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    per = 16 * MIB // 2  # bf16 elements per tensor
    tensors = {
        f"model.layers.{i}.weight": torch.randn(per // 4096, 4096, generator=gen).bfloat16()
        for i in range(mib // 16)
    }
    save_file(tensors, d / "model.safetensors")
    (d / "config.json").write_text('{"model_type": "qwen2"}')
    return d


def _copy(src: Path, dst: Path) -> float:
    dst.mkdir(parents=True)
    t0 = time.perf_counter()
    for p in sorted(src.iterdir()):
        shutil.copyfile(p, dst / p.name)
    return time.perf_counter() - t0


async def _nats(ctx: Context, src: Path, repeats: int) -> dict[str, float]:
    """Best-of-repeats seconds: upload (trainer), chunked fetch (rollout), nats-py get()."""
    with LocalNatsServer(ctx.work_dir / "weights-js") as server:
        trainer = await connect(server.url, identity="trainer")
        rollout = await connect(server.url, identity="rollout")
        admin = await connect(server.url, identity="scheduler")  # get() looks streams up
        try:
            best = {"upload": [], "fetch": []}
            for i in range(repeats):
                t0 = time.perf_counter()
                uri = await upload_version(trainer.jetstream(timeout=30), src, EXP, 1)
                t1 = time.perf_counter()
                await fetch_version(rollout.jetstream(), uri, ctx.work_dir / f"cache-{i}")
                best["upload"].append(t1 - t0)
                best["fetch"].append(time.perf_counter() - t1)
            obs = await admin.jetstream(timeout=600).object_store(WEIGHTS_BUCKET)
            name = f"{version_prefix(EXP, 1)}/model.safetensors"
            t0 = time.perf_counter()
            got = await obs.get(name)  # once: it is slow
            best["get"] = [time.perf_counter() - t0]
            assert len(got.data) == (src / "model.safetensors").stat().st_size
            return {k: min(v) for k, v in best.items()}
        finally:
            for nc in (trainer, rollout, admin):
                await nc.drain()


def run(ctx: Context) -> list[Result]:
    mib = ctx.size(256, 64)
    src = _version(ctx.work_dir, mib)
    size = sum(p.stat().st_size for p in src.iterdir()) / MIB
    model = (src / "model.safetensors").stat().st_size / MIB
    copy_s = min(_copy(src, ctx.work_dir / f"copy-{i}") for i in range(ctx.repeats))
    s = asyncio.run(_nats(ctx, src, ctx.repeats))
    settings = {
        "version_mib": round(size, 1),
        "chunk_kib": CHUNK_SIZE // 1024,
        "nats": "secure nats-server on loopback (TLS, users), file storage, R1",
        "upload_s": round(s["upload"], 3),
        "fetch_s": round(s["fetch"], 3),
        "copyfile_s": round(copy_s, 3),
        "nats_py_get_s": round(s["get"], 3),
    }
    transfer_s = s["upload"] + s["fetch"]
    return [
        Result(
            NAME,
            "version MiB/s: object store upload + chunked fetch",
            size / transfer_s,
            "MiB/s",
            "shutil.copyfile of the same files on one host",
            size / copy_s,
            settings,
        ),
        Result(
            NAME,
            "safetensors MiB/s: chunked fetch (the whole version)",
            size / s["fetch"],
            "MiB/s",
            "nats-py ObjectStore.get() of the safetensors object",
            model / s["get"],
            settings,
        ),
    ]
