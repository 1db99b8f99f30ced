"""Read run logs back with the libraries' own readers (tests only).

TensorBoard: its EventAccumulator. W&B: wandb 0.31 ships no Python reader of a run's `.wandb`
file any more (wandb-core, in Go, reads it), so `wandb_history` walks its framing, the LevelDB
log format (https://github.com/google/leveldb/blob/main/doc/log_format.md: 32 KiB blocks of
records `crc32 u32 | length u16 | type u8 | data`, type FULL=1 FIRST=2 MIDDLE=3 LAST=4) after
wandb's 7-byte header (`:W&B`, magic 0xBEE1, version 0), and decodes each record with wandb's
own protobuf, `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag -> [(step, value)] from the event files in `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path: Path):
    """The Records of one `.wandb` file, in order (checksums verified)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert HEADER.unpack_from(data) == (b":W&B", 0xBEE1, 0), "not a .wandb file"
    pos, pending = HEADER.size, b""
    while pos + CHUNK.size <= len(data):
        if BLOCK - pos % BLOCK < CHUNK.size:  # a block's trailer: too short for a header
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        chunk = data[pos + CHUNK.size : pos + CHUNK.size + length]
        pos += CHUNK.size + length
        if kind == 0 and length == 0:  # zero padding at the end of a block
            continue
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad checksum at {pos}"
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_root: Path) -> list[dict]:
    """The history rows (`run.log` calls) of the one offline run under `run_root`."""
    files = sorted(run_root.glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {run_root}: {files}"
    rows = []
    for record in wandb_records(files[0]):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def assert_run_logs(run: Path, exp) -> None:
    """An experiment's run directory holds its steps and evals in TensorBoard and W&B: the
    loss of every step of `exp.history` and the accuracy of every eval, at their versions."""
    import pytest

    steps = [(h.version, h.loss) for h in exp.history]
    evals = sorted((e.version, e.accuracy) for e in exp.progress.evals)
    assert steps and evals
    tb = tensorboard_scalars(run / "tensorboard")
    assert tb["train/loss"] == [(v, pytest.approx(x, rel=1e-6)) for v, x in steps]  # float32
    assert tb["eval/accuracy"] == [(v, pytest.approx(x, rel=1e-6)) for v, x in evals]
    assert [v for v, _ in tb["weight_update/commit_s"]] == [v for v, _ in steps]
    rows = wandb_history(run / "wandb")
    assert [(r["version"], r["train/loss"]) for r in rows if "train/loss" in r] == steps
    assert [(r["version"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r] == evals
