"""`asyncrl export`: a trained version as a HuggingFace model directory.

    asyncrl export ID [--version N] --out DIR [--adapter-only]

The scheduler says which version is the newest committed and where it is
(`Experiment.weights_version`, `weights_uri`: a directory of the weight store, or a
`nats-obj://` version in the NATS object store, fetched here chunk by chunk and checked); an
older version is looked for next to it (the trainer keeps the newest few, and always the run's
final one). What DIR gets:

- a full-parameter run: config.json and model.safetensors (sharded past `MAX_SHARD`) in the
  base model's dtype (its config.json `torch_dtype`: bf16 for most released models, whatever
  dtype the trainer published in);
- a LoRA run: the base with the adapter merged (`W + scale * B @ A`, peft's `merge_and_unload`)
  in the base's dtype, or with `--adapter-only` the adapter as peft saves it
  (adapter_model.safetensors, adapter_config.json naming the base);
- every tokenizer file the base had (`asyncrl.weights.tokenizer_files`: tokenizer.model too),
  the generation config and chat template, as they came with the version;
- `asyncrl_export.json`: experiment, version, the weights' fingerprint, where they came from.

`transformers.AutoModelForCausalLM.from_pretrained(DIR)` (and SGLang's `--model-path DIR`)
loads it. DIR is written beside itself and renamed into place; an existing non-empty DIR is
refused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from asyncrl import fingerprint
from asyncrl.errors import BadRequest, NotFound
from asyncrl.weights import tokenizer_files, uri_to_path, version_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PROVENANCE = "asyncrl_export.json"
MAX_SHARD = "5GB"


@dataclass(frozen=True)
class Source:
    """Where the version to export is: its URI, and the base model it was trained from."""

    experiment_id: str
    version: int
    uri: str
    """file:// (or a path) or nats-obj://; "" for v0, the base itself."""
    base: Path
    """The spec's model.path."""
    tokenizer: Path
    """The spec's model.tokenizer_path, else model.path."""
    lora: bool


def source_of(exp, version: int | None) -> Source:
    """The `Source` of `version` (None: the newest committed) of experiment `exp` (the
    scheduler's `Experiment`). BadRequest for a version the run has not reached."""
    spec = json.loads(exp.spec_json)
    model = spec["model"]
    newest = exp.weights_version
    if version is None:
        version = newest
    if version < 0 or version > newest:
        raise BadRequest("version", f"v{version}: {exp.id} has versions 0..{newest}")
    uri = exp.weights_uri if version == newest else sibling_uri(exp.weights_uri, version)
    return Source(
        experiment_id=exp.id,
        version=version,
        uri="" if version == 0 else uri,
        base=Path(model["path"]),
        tokenizer=Path(model.get("tokenizer_path") or model["path"]),
        lora=bool((spec.get("trainer") or {}).get("lora")),
    )


def sibling_uri(newest_uri: str, version: int) -> str:
    """The URI of `version` of the experiment whose newest version is at `newest_uri`."""
    from asyncrl.weights_nats import is_nats_uri, parse_uri, version_uri

    if is_nats_uri(newest_uri):
        bucket, prefix = parse_uri(newest_uri)
        return version_uri(prefix.partition("/")[0], version, bucket)
    newest = uri_to_path(newest_uri)
    return version_dir(newest.parent.parent, newest.parent.name, version).as_uri()


async def fetch(source: Source, nats_url: str, cache: Path) -> Path:
    """The version as a local directory: in place for a file URI, fetched into `cache` for
    a nats-obj:// one; the base model's directory for v0."""
    if not source.uri:
        return source.base
    from asyncrl.weights_nats import fetch_version, is_nats_uri

    if not is_nats_uri(source.uri):
        path = uri_to_path(source.uri)
        if not path.is_dir():
            raise NotFound(f"v{source.version} of {source.experiment_id}: no {path} (pruned?)")
        return path
    from asyncrl import natsutil

    nc = await natsutil.connect(nats_url, max_reconnect_attempts=2)
    try:
        return await fetch_version(nc.jetstream(), source.uri, cache)
    finally:
        await nc.drain()


def export(source: Source, version_path: Path, out: Path, adapter_only: bool = False) -> Path:
    """Write the HuggingFace directory of `source` (its files at `version_path`) to `out`."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadRequest("out", f"{out} exists and is not empty")
    adapter = (version_path / ADAPTER_CONFIG).is_file()
    if adapter_only and not adapter:
        raise BadRequest("adapter_only", f"v{source.version} is not a LoRA adapter")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        if adapter_only:
            _write_adapter(source, version_path, tmp)
        else:
            _write_model(source, version_path, tmp, adapter)
        _copy_tokenizer(source, version_path, tmp)
        provenance = {
            "experiment": source.experiment_id,
            "version": source.version,
            "fingerprint": fingerprint.read_manifest(version_path),
            "uri": source.uri or str(source.base),
            "base": str(source.base),
            "adapter_only": adapter_only,
        }
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def base_dtype(source: Source, version_path: Path):
    """The dtype of the base model's config.json (the version's own config when the base is
    not on this host)."""
    from asyncrl.devices import model_dtype

    where = source.base if (source.base / "config.json").is_file() else version_path
    return model_dtype(where)


def _write_model(source: Source, version_path: Path, dst: Path, adapter: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = base_dtype(source, version_path)
    if adapter:
        from peft import PeftModel

        if not (source.base / "config.json").is_file():
            raise NotFound(f"the base model {source.base} (needed to merge the adapter)")
        base = AutoModelForCausalLM.from_pretrained(source.base, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(version_path)).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(version_path, dtype=torch.float32)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(dst, safe_serialization=True, max_shard_size=MAX_SHARD)


def _write_adapter(source: Source, version_path: Path, dst: Path) -> None:
    shutil.copy2(version_path / ADAPTER_WEIGHTS, dst / ADAPTER_WEIGHTS)
    config = json.loads((version_path / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(source.base)
    (dst / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(source: Source, version_path: Path, dst: Path) -> None:
    """The tokenizer's files as the version carries them, and any the base has that the
    version lacks (the base itself for v0)."""
    for src in (version_path, source.tokenizer):
        for name in tokenizer_files(src):
            if not (dst / name).exists():
                shutil.copy2(Path(src) / name, dst / name)


def cache_dir() -> Path:
    """Where nats-obj:// versions are fetched to (removed after the export)."""
    return Path(tempfile.mkdtemp(prefix="asyncrl-export-"))
