"""Part `weights`: a trained version into two torch engines on the device, per transport
(bench/weights.py's measurement: one torch trainer backend and two engines in one process,
all on the one GPU, as `make up` places them on a one-GPU machine).

Per transport, the best of `repeats`: train end -> both engines serving, the trainer's stall,
and the phases: gather (the parameters packed into the buckets), seal (their checksums), send
(the trainer's side of the stream), receive (an engine's side, hello to checked) and apply
(into the model, the engine paused); beside them a device-to-device copy of the bytes the
version moves into the engines, measured in the same run. On one GPU the trainer and the
engines meet over gloo (NCCL refuses two ranks on one device), which stages the buckets
through host memory; `disk` is the weight store's path (serialise, write, read, load).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.gpu.shapes import build
from bench.weights import ENGINES, measure

GPU_TRANSPORTS = ("disk", "broadcast", "broadcast+delta")
CPU_TRANSPORTS = ("disk", "broadcast shm", "broadcast")
"""The dry run's: on the CPU the engines of the trainer's host take versions through /dev/shm."""
PHASES = ("pack_s", "seal_s", "send_s", "receive_s", "apply_s")


def run(shape: str, work: Path, sizes: dict, device: str) -> dict:
    """`sizes` = {repeats}."""
    model_dir = build(shape, work / "models" / shape)
    transports = GPU_TRANSPORTS if device == "cuda" else CPU_TRANSPORTS
    best, nbytes, bounds = asyncio.run(
        measure(model_dir, work / f"weights-{shape}", sizes["repeats"], device, transports)
    )
    bound = bounds["memcpy"]
    rows = {}
    for transport, got in best.items():
        rows[transport] = {
            "serving_s": float(f"{got['serving_s']:.4g}"),
            "x_copy": round(got["serving_s"] / bound, 1),
            "stall_s": round(got["stall_s"], 4),
            **{k: round(got[k], 4) for k in PHASES if k in got},
            "sent_mib": round(got.get("sent_mib", nbytes / (1 << 20)), 2),
        }
    return {
        "shape": shape,
        "device": device,
        "version_mib": round(nbytes / (1 << 20), 1),
        "engines": ENGINES,
        "repeats": sizes["repeats"],
        "copy_s": float(f"{bound:.4g}"),
        "transports": rows,
    }
