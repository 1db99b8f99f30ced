"""The one weights-transport knob (`trainer.weight_sync`, services/trainer/transport.py), its
deprecated alias ASYNCRL_WEIGHTS_TRANSPORT=nats, and the disk sender against a real weight
store. The NATS sender end to end: tests/integration/test_weights_nats.py; the NCCL one:
tests/integration/test_trainer_weight_sync.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save
from structlog.testing import capture_logs

from asyncrl.fingerprint import of_files
from asyncrl.logging import get_logger
from asyncrl.spec import validate_spec
from asyncrl.weights import path_to_uri
from services.trainer.transport import (
    DiskSender,
    NatsSender,
    NcclSender,
    Store,
    sender_for,
)

MINIMAL = {"model": {"path": "m"}, "dataset": {"path": "d.jsonl"}}
NCCL = {"nccl_master": "127.0.0.1:29500", "nccl_world_size": 2}


def _trainer(weight_sync: str):
    extra = NCCL if weight_sync == "nccl" else {}
    return validate_spec(MINIMAL | {"trainer": {"weight_sync": weight_sync} | extra}).trainer


def _store(tmp_path) -> Store:
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    (tok / "tokenizer.json").write_text("{}")
    return Store(root=tmp_path / "weights", experiment_id="e", tokenizer_dir=tok, keep=2)


def _kind(sender) -> tuple[str, str]:
    """(the sender's name, how its files travel)."""
    files = sender.files if isinstance(sender, NcclSender) else sender
    return sender.name, files.name


@pytest.mark.parametrize(
    ("weight_sync", "env", "want", "deprecated"),
    [
        ("disk", None, ("disk", "disk"), False),
        ("nats", None, ("nats", "nats"), False),
        ("nccl", None, ("nccl", "disk"), False),
        ("disk", "file", ("disk", "disk"), False),
        ("disk", "nats", ("nats", "nats"), True),  # the alias turns disk into nats
        ("nats", "nats", ("nats", "nats"), False),  # already what the alias asks
        ("nccl", "nats", ("nccl", "nats"), True),  # as before: broadcast, files through NATS
    ],
)
def test_weight_sync_picks_sender_env_alias_maps_onto_it(
    weight_sync, env, want, deprecated, tmp_path, monkeypatch
):
    if env is None:
        monkeypatch.delenv("ASYNCRL_WEIGHTS_TRANSPORT", raising=False)
    else:
        monkeypatch.setenv("ASYNCRL_WEIGHTS_TRANSPORT", env)
    with capture_logs() as logs:
        sender = sender_for(_trainer(weight_sync), _store(tmp_path), None, None, get_logger())
    assert _kind(sender) == want
    warned = [line for line in logs if line["event"] == "deprecated_setting"]
    assert [w["use"] for w in warned] == (
        ["trainer.weight_sync: nats in the experiment spec"] if deprecated else []
    )
    if isinstance(sender, NcclSender):
        assert sender.broadcaster.group is None  # joins at the first send, not before


def test_uris_base_model_is_empty_then_file_or_nats(tmp_path):
    store = _store(tmp_path)
    disk, nats = DiskSender(store), NatsSender(store, None, None, None)
    assert (disk.uri(0), nats.uri(0)) == ("", "")
    assert disk.uri(3) == path_to_uri(tmp_path / "weights" / "e" / "v000003")
    assert nats.uri(3) == "nats-obj://asyncrl_weights/e/v000003"


async def test_disk_sender_publishes_files_with_tokenizer_keeps_newest_and_restores(tmp_path):
    store = _store(tmp_path)
    sender = DiskSender(store)
    weights = save({"w": torch.tensor([1.0, 2.0])})
    files = {"model.safetensors": weights, "config.json": b'{"a": 1}'}
    uris = [await sender.publish(v, files) for v in (1, 2, 3)]
    assert uris == [sender.uri(v) for v in (1, 2, 3)]
    kept = sorted(p.name for p in (tmp_path / "weights" / "e").iterdir())
    assert kept == ["v000002", "v000003"]  # keep=2
    d = store.dir(3)
    manifest = json.dumps({"version": 3, "fingerprint": of_files(files)}).encode() + b"\n"
    assert {p.name: p.read_bytes() for p in d.iterdir()} == files | {
        "tokenizer.json": b"{}",
        "fingerprint.json": manifest,
    }
    assert sender.fingerprint(3) == of_files(files)
    calls = []
    await sender.restore(3, lambda: calls.append(3) or files)  # there: nothing written
    await sender.restore(1, lambda: calls.append(1) or files)  # pruned: written again
    assert calls == [1]  # and kept: the versions above it, an abandoned lineage, go
    assert (store.dir(1) / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in (tmp_path / "weights" / "e").iterdir()) == ["v000001"]
    assert await sender.send(1, _answer("committed")) == "committed"


async def _answer(value):
    return value
