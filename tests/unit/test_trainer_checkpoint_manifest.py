"""Trainer checkpoints verify on load: manifest.json lists the size and sha256 of every file a
checkpoint holds; a file that differs (garbage, zeros, a cut) makes the checkpoint Damaged,
naming the file, and `resume_point` sets it aside and resumes from the newest good one."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from structlog.testing import capture_logs

from services.trainer import checkpoint
from services.trainer.checkpoint import (
    DAMAGED_DIR,
    MANIFEST_FILE,
    STATE_FILE,
    CheckpointState,
    Damaged,
    latest_checkpoint,
    resume_point,
    write_checkpoint,
)

WEIGHTS = b"weights of step %d " * 1000  # 16-17 KB: room for 4 KiB of garbage inside


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    monkeypatch.setattr(checkpoint, "_WRITTEN", checkpoint._Written())


def _write(root, step: int):
    def save(d):
        (d / "model.pt").write_bytes(WEIGHTS.replace(b"%d", str(step).encode()))

    ids = tuple(f"g{i}" for i in range(step * 4))
    return write_checkpoint(root, CheckpointState("e", step, step, step * 4, ids), save)


def test_manifest_lists_size_and_sha256_of_every_file(tmp_path):
    path = _write(tmp_path, 1)
    listed = json.loads((path / MANIFEST_FILE).read_text())["files"]
    model = WEIGHTS.replace(b"%d", b"1")
    state = (path / STATE_FILE).read_bytes()
    assert listed == {  # sha256 as hashlib computes it (FIPS 180-4)
        "backend/model.pt": {"bytes": len(model), "sha256": hashlib.sha256(model).hexdigest()},
        STATE_FILE: {"bytes": len(state), "sha256": hashlib.sha256(state).hexdigest()},
    }
    assert json.loads(state)["manifest"] == MANIFEST_FILE


def _garbage(path):
    """4 KiB of garbage written into the middle of `path`, its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(os.urandom(4096))


def _zeroed(path):
    path.write_bytes(bytes(os.path.getsize(path)))


def _truncated(path):
    os.truncate(path, os.path.getsize(path) // 3)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_garbage, r"^sha256 [0-9a-f]{16} is not the manifest's [0-9a-f]{16}$"),
        (_zeroed, r"^sha256 [0-9a-f]{16} is not the manifest's [0-9a-f]{16}$"),
        (_truncated, r"^\d+ bytes, the manifest says \d+$"),
    ],
)
def test_damaged_file_names_it_and_newest_good_one_resumes(tmp_path, damage, reason):
    _write(tmp_path, 1)
    newest = _write(tmp_path, 2)
    damage(newest / "backend" / "model.pt")
    with pytest.raises(Damaged, match=reason) as e:
        latest_checkpoint(tmp_path)
    assert e.value.file == newest / "backend" / "model.pt"
    with capture_logs() as logs:
        path, state = resume_point(tmp_path)
    assert (path.name, state.step, state.trained_ids) == (
        "step_000001",
        1,
        ("g0", "g1", "g2", "g3"),
    )
    [event] = [e for e in logs if e["event"] == "checkpoint_set_aside"]
    [aside] = (tmp_path / DAMAGED_DIR).iterdir()
    assert event == {
        "event": "checkpoint_set_aside",
        "log_level": "error",
        "checkpoint": str(newest),
        "file": str(newest / "backend" / "model.pt"),
        "reason": e.value.reason,
        "moved_to": str(aside),
    }
    assert (aside / "backend" / "model.pt").is_file()  # renamed, not deleted
    ids_log = json.loads((aside / STATE_FILE).read_text())["trained_ids_log"]["file"]
    assert (aside / ids_log).is_file()  # with a copy of the trained-ids log it named


def test_damaged_state_or_manifest_is_damage_too(tmp_path):
    first = _write(tmp_path, 1)
    (first / STATE_FILE).write_bytes(b"\0" * 10)  # no manifest check can save a zeroed state
    (first / MANIFEST_FILE).unlink()
    with pytest.raises(Damaged, match="^unreadable state") as e:
        latest_checkpoint(tmp_path)
    assert e.value.file == first / STATE_FILE
    second = _write(tmp_path, 2)
    (second / MANIFEST_FILE).unlink()  # its state.json says it has one
    with pytest.raises(Damaged, match="^missing manifest$"):
        latest_checkpoint(tmp_path)
    third = _write(tmp_path, 3)
    (third / MANIFEST_FILE).write_text("{")
    with pytest.raises(Damaged, match="^unreadable manifest"):
        latest_checkpoint(tmp_path)
    with capture_logs() as logs:
        assert resume_point(tmp_path) is None  # nothing good left: a fresh start
    assert not first.exists()  # pruned by step 3 (keep 2)
    assert [e["checkpoint"] for e in logs if e["event"] == "checkpoint_set_aside"] == [
        str(third),
        str(second),
    ]
    assert len(os.listdir(tmp_path / DAMAGED_DIR)) == 2


def test_checkpoint_written_before_manifests_reads_unverified(tmp_path):
    d = tmp_path / "step_000001"
    (d / "backend").mkdir(parents=True)
    (d / "backend" / "model.pt").write_bytes(b"anything")
    state = {"experiment_id": "e", "step": 1, "version": 1, "last_seq": 4, "trained_ids": []}
    (d / STATE_FILE).write_text(json.dumps(state))
    assert resume_point(tmp_path) == (d, CheckpointState("e", 1, 1, 4, ()))


def test_step_set_aside_is_written_again_by_the_resumed_run(tmp_path):
    _write(tmp_path, 1)
    _garbage(_write(tmp_path, 2) / "backend" / "model.pt")
    with capture_logs():
        assert resume_point(tmp_path)[0].name == "step_000001"
    again = _write(tmp_path, 2)
    assert latest_checkpoint(tmp_path)[0] == again
    assert resume_point(tmp_path)[1].trained_ids == tuple(f"g{i}" for i in range(8))
