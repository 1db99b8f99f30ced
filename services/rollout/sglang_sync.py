"""The engine's half of the collective weight update into SGLang (`weight_sync: nccl`).

Protocol (SGLang's `update_weights_from_distributed`, as AReaL and slime use it), the trainer
being rank 0:
  1. once: the engine POSTs `/init_weights_update_group` (master address/port of the trainer,
     `rank_offset`, `world_size`, `group_name`, backend) at its first collective update, while
     the trainer joins the same group; both block until the rendezvous completes.
  2. per update: the engine POSTs `/update_weights_from_distributed` bucket by bucket (names,
     dtypes, shapes in HF naming, full shapes); each call returns after SGLang has received
     that bucket. From SGLang 0.5.21 the buckets must come between `POST /begin_weight_update`
     and `POST /end_weight_update` (the session; a 400 otherwise), closed whatever happens. Concurrently the trainer broadcasts every tensor, one broadcast each, in the
     same order.

Both sides order tensors by name, so the trainer needs no bucket plan: buckets only group the
engine's HTTP calls. The engine reads names, dtypes and shapes from the safetensors headers of
the version directory the trainer writes to the weight store (a restarted server reloads from
there); the trainer broadcasts the tensors of that same directory. The trainer's half is
services/trainer/weight_sync.py (`trainer.weight_sync: nccl` in the experiment spec).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.logging import get_logger
from services.rollout.sglang_protocol import SGLangError, session_body

log = get_logger(component="sglang_sync")

Request = Callable[[str, str, dict | None], Awaitable[dict]]
"""An HTTP call to the server: (method, path, JSON body) -> the answer; SGLangError on error."""

# safetensors dtype codes -> torch dtype names (what SGLang's `dtypes` field expects)
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file; ValueError when the file is not one."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header size)")
        (size,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise ValueError(f"{path}: not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header


def tensor_metas(model_dir: str | Path) -> list[TensorMeta]:
    """Names, dtypes and shapes of every tensor of a HF safetensors checkpoint, by name."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    metas = []
    for f in files:
        for name, info in read_safetensors_header(f).items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise ValueError(f"{f}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
            metas.append(TensorMeta(name, dtype, tuple(info["shape"])))
    return sorted(metas, key=lambda m: m.name)


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Split tensors (in order) into buckets of at most `bucket_bytes`; a tensor larger than
    that gets a bucket of its own."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for m in metas:
        if not buckets or (size + m.nbytes > bucket_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(m)
        size += m.nbytes
    return buckets


def bucket_request(
    bucket: list[TensorMeta], group_name: str, version: int | None, last: bool
) -> dict:
    """The JSON body of one `/update_weights_from_distributed` call."""
    body = {
        "names": [m.name for m in bucket],
        "dtypes": [m.dtype for m in bucket],
        "shapes": [list(m.shape) for m in bucket],
        "group_name": group_name,
        "flush_cache": last,
    }
    if last and version is not None:
        body["weight_version"] = str(version)
    return body


async def receive_version(
    request: Request,
    model_dir: str,
    *,
    group: str,
    bucket_bytes: int,
    weight_version: int | None,
    session: bool,
) -> None:
    """The engine's calls of one collective update of `model_dir` (the trainer broadcasts
    concurrently): its buckets, inside a weight-update session when `session`."""
    buckets = plan_buckets(await asyncio.to_thread(tensor_metas, model_dir), bucket_bytes)
    if not session:
        await _send_buckets(request, buckets, group, weight_version)
        return
    await _begin_session(request)
    received = False
    try:
        await _send_buckets(request, buckets, group, weight_version)
        received = True
    finally:
        await _end_session(request, raise_errors=received)


async def _send_buckets(
    request: Request, buckets: list[list[TensorMeta]], group: str, version: int | None
) -> None:
    for i, bucket in enumerate(buckets):
        body = bucket_request(bucket, group, version, last=i == len(buckets) - 1)
        await request("POST", "/update_weights_from_distributed", body)


async def _begin_session(request: Request) -> None:
    """`/begin_weight_update`; a session some earlier update left open (the server says so
    with a 400) is closed first, once."""
    try:
        await request("POST", "/begin_weight_update", session_body())
    except SGLangError as exc:
        if exc.status != 400 or "already open" not in str(exc):
            raise
        log.warning("sglang_update_session_left_open", error=str(exc))
        await request("POST", "/end_weight_update", session_body())
        await request("POST", "/begin_weight_update", session_body())


async def _end_session(request: Request, raise_errors: bool) -> None:
    """`/end_weight_update`; its failure is raised only when nothing else failed."""
    try:
        await request("POST", "/end_weight_update", session_body())
    except Exception as exc:
        if raise_errors:
            raise
        log.warning("sglang_end_weight_update_failed", error=str(exc))
