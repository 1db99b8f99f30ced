"""A version's weights fingerprint: one content hash that the trainer, every rollout engine and
the tests compute the same way, from the files as written, the files as read, or the tensors an
engine holds.

Canonical form: for each tensor in name order, its name, its safetensors dtype ("F32", "BF16",
...), its shape and its raw bytes (little-endian, row-major: what a safetensors file stores) go
into one sha256. Which files or shards the tensors came in, and their order inside a file, do
not matter; config.json and the tokenizer are not part of it (they are not weights). The cost is
one sha256 pass over the weights and no copy of them (memoryview slices): on this project's
2-core machine 128 MiB of fp32 took 0.09 s from the files' bytes (~1.4 GiB/s), so a 1.5B bf16
model (3 GiB) is ~2 s, off the trainer's critical path (the publish task) and, on a rollout,
in the read phase before generation pauses.

A version streamed by `trainer.weight_sync: broadcast` has the other kind, a bucket fingerprint
(`asyncrl.buckets`: xxh3 per bucket, `xxh3/b<bucket bytes>:...`); its manifest in the weight
store records that one, and `of_dir` / `of_state(..., like=)` compute the kind they are asked
to prove.

"" means unverified: an engine that cannot say what it holds, or a message from before the
field existed. It is counted, never treated as a mismatch.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl import buckets

if TYPE_CHECKING:
    import torch

PREFIX = "sha256:"
MANIFEST = "fingerprint.json"
"""The version's manifest in the weight store: {"version": v, "fingerprint": "sha256:..."}."""

_TORCH_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
"""torch dtype name -> safetensors dtype (safetensors' own table, safetensors/src/tensor.rs)."""


def _digest(tensors: Iterable[tuple[str, str, list[int], memoryview]]) -> str:
    h = hashlib.sha256()
    for name, dtype, shape, data in sorted(tensors, key=lambda t: t[0]):
        h.update(json.dumps([name, dtype, list(shape), len(data)]).encode())
        h.update(data)
    return PREFIX + h.hexdigest()


def _safetensors_tensors(data: bytes) -> list[tuple[str, str, list[int], memoryview]]:
    """The tensors of one safetensors file: an 8-byte little-endian header length, a JSON header
    (name -> dtype, shape, data_offsets into the bytes after it), then the bytes."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = memoryview(data)[8 + n :]
    return [
        (name, t["dtype"], t["shape"], body[t["data_offsets"][0] : t["data_offsets"][1]])
        for name, t in header.items()
        if name != "__metadata__"
    ]


def of_files(files: Mapping[str, bytes]) -> str:
    """The fingerprint of a version given as its files (name -> bytes): every *.safetensors."""
    tensors = []
    for name, data in files.items():
        if name.endswith(".safetensors"):
            tensors += _safetensors_tensors(data)
    return _digest(tensors) if tensors else ""


def of_dir(model_dir: str | Path) -> str:
    """The fingerprint of the *.safetensors files in `model_dir`, as read now, of the kind its
    manifest records (a bucket fingerprint for a streamed version, else sha256)."""
    d = Path(model_dir)
    like = read_manifest(d)
    if buckets.bucket_bytes_of(like) is not None:
        from asyncrl.weights import load_state_dict_files

        return of_state(load_state_dict_files(d), like=like)
    return of_files({p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))})


def of_state(state: Mapping[str, torch.Tensor], like: str = "") -> str:
    """The fingerprint of tensors in memory (a state dict): equal to `of_files` of the
    safetensors files they were saved to or loaded from; of the bucket kind when `like` is a
    bucket fingerprint (the version's manifest or the committed one)."""
    size = buckets.bucket_bytes_of(like)
    if size is not None:
        return buckets.fingerprint_of_state(state, size)

    def raw(t: torch.Tensor) -> memoryview:
        import torch

        flat = t.detach().to("cpu").contiguous().reshape(-1)
        return memoryview(flat.view(torch.uint8).numpy())  # no copy of the bytes

    return _digest(
        (name, _TORCH_DTYPES[str(t.dtype).removeprefix("torch.")], list(t.shape), raw(t))
        for name, t in state.items()
    )


def write_manifest(version_dir: Path, version: int, fingerprint: str) -> None:
    body = json.dumps({"version": version, "fingerprint": fingerprint})
    (Path(version_dir) / MANIFEST).write_text(body + "\n")


def read_manifest(version_dir: Path) -> str:
    """The fingerprint the trainer recorded for the version in `version_dir`; "" if none (a
    version written before fingerprints existed, the base model)."""
    path = Path(version_dir) / MANIFEST
    if not path.is_file():
        return ""
    return str(json.loads(path.read_text()).get("fingerprint", ""))


def differs(a: str, b: str) -> bool:
    """Both fingerprints known and not the same: a mismatch ("" on either side is unverified)."""
    return bool(a and b and a != b)


def stamp(versions: Iterable[int], known: Mapping[int, str]) -> dict[int, str]:
    """A group's fingerprints: for each version that produced its samples' tokens, the
    fingerprint of the weights the engine held for it ("" where unknown: unverified)."""
    return {v: known.get(v, "") for v in sorted(set(versions))}
