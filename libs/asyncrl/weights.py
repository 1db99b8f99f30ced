"""The weight store: one directory of HuggingFace-format safetensors per version.

Layout: <root>/<experiment>/v<version>/ with config.json, model.safetensors and the tokenizer
files, written to a temporary directory and renamed into place (readers never see a partial
version). URIs are file:// URLs of that directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

if TYPE_CHECKING:
    import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
NOT_TOKENIZER = frozenset(
    {
        "config.json",
        "model.safetensors.index.json",
        "pytorch_model.bin.index.json",
        "adapter_config.json",
        "fingerprint.json",  # asyncrl.fingerprint.MANIFEST: a version's own
        "asyncrl_export.json",  # asyncrl.export.PROVENANCE: an exported model's own
    }
)


def tokenizer_files(model_dir: str | Path) -> list[str]:
    """What goes with every version besides the weights: each top-level file of the model
    directory that is neither weights (`WEIGHT_SUFFIXES`, their indexes) nor config.json,
    whatever the tokenizer calls its files (tokenizer.json, tokenizer.model, vocab.json +
    merges.txt, tekken.json, a tokenization_*.py), generation_config.json and the chat
    template included. Sorted; hidden files left out."""
    d = Path(model_dir)
    if not d.is_dir():
        return []
    return sorted(
        p.name
        for p in d.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and p.name not in NOT_TOKENIZER
        and not p.name.endswith(WEIGHT_SUFFIXES)
    )


def uri_to_path(uri: str) -> Path:
    if uri.startswith("file://"):
        return Path(urlparse(uri).path)
    return Path(uri)


def path_to_uri(path: Path) -> str:
    return Path(path).absolute().as_uri()


def version_dir(root: Path, experiment_id: str, version: int) -> Path:
    return Path(root) / experiment_id / f"v{version:06d}"


def load_state_dict_files(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HuggingFace directory: model.safetensors, or every shard named by
    model.safetensors.index.json."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(str(d / shard)))
        return state
    single = d / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors in {d}")
    return load_file(str(single))


def copy_tokenizer(src_dir: Path, dst_dir: Path) -> None:
    """Every file `tokenizer_files` finds in `src_dir`, copied into `dst_dir`."""
    for name in tokenizer_files(src_dir):
        shutil.copy2(Path(src_dir) / name, Path(dst_dir) / name)


def publish_version(tmp_dir: Path, final_dir: Path) -> str:
    """Atomically move a fully written version directory into place; return its URI."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.replace(tmp_dir, final_dir)
    return path_to_uri(final_dir)


def prune(
    root: Path,
    experiment_id: str,
    keep: int = 3,
    protect: Path | None = None,
    newest: int | None = None,
) -> None:
    """Remove all but the newest `keep` versions of an experiment, and never `protect` (the
    version just put there for a reader: after a rewind it is older than the ones kept).

    `newest`: the version the trainer just wrote. It writes its versions in order, so one
    above it is of an abandoned lineage (trained after the checkpoint it resumed from, lost with
    that process, to be trained again): removed, and the newest `keep` counted from `newest`
    down. By name alone, after a deep rewind (v37 -> v30) the abandoned v35..v37 would be the
    newest and the v30, v31 just written for the fleet would go. For the same reason a
    temporary directory of a version up to `newest` (`.tmp-v<N>-*`) is no writer's any more: a
    trainer killed while it wrote it left it behind; it is removed too."""
    d = Path(root) / experiment_id
    if not d.exists():
        return
    versions = sorted(p for p in d.iterdir() if p.is_dir() and p.name.startswith("v"))
    if newest is not None:
        for p in d.glob(".tmp-v*-*"):
            number = p.name.removeprefix(".tmp-v").split("-", 1)[0]
            if number.isdigit() and int(number) <= newest:
                shutil.rmtree(p, ignore_errors=True)
        abandoned = [p for p in versions if p.name[1:].isdigit() and int(p.name[1:]) > newest]
        for p in abandoned:
            shutil.rmtree(p, ignore_errors=True)
        versions = [p for p in versions if p not in abandoned]
    for p in versions[:-keep]:
        if protect is None or p != Path(protect):
            shutil.rmtree(p, ignore_errors=True)


class WeightReceiver:
    """The rollout's side of the weights transport (the trainer's: services/trainer/transport.py):
    the URI a commit carries -> the version's directory on this host, HF safetensors (a name ->
    tensor mapping) and config.json, which every engine loads (an NCCL engine reads the tensors'
    names and shapes there and receives their values over its weight-update group). This one
    reads a file:// URI or a path in place (a filesystem shared with the trainer; the base
    model); `asyncrl.weights_nats.NatsReceiver` also fetches nats-obj:// ones."""

    async def receive(self, version: int, uri: str, fingerprint: str = "") -> Path:
        """`fingerprint`: the one committed with the version ("" unknown); a receiver that
        caches serves no cached copy of other weights under it."""
        return uri_to_path(uri)
