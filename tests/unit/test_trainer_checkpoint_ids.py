"""The trained ids in trainer checkpoints: a step appends the ids trained since the previous
checkpoint to a log (O(groups per step)); what a checkpoint reads back is always the whole list
it was given, whatever was appended or cut off after it."""

from __future__ import annotations

import json
import os

import pytest

from services.trainer import checkpoint
from services.trainer.checkpoint import (
    IDS_DIR,
    STATE_FILE,
    CheckpointState,
    latest_checkpoint,
    read_state,
    write_checkpoint,
)
from services.trainer.validation import RecentIds

B = 32


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    """Each test starts as a process that has written nothing."""
    monkeypatch.setattr(checkpoint, "_WRITTEN", checkpoint._Written())


def _restart(monkeypatch):
    """As after a restart: nothing this process wrote is known any more."""
    monkeypatch.setattr(checkpoint, "_WRITTEN", checkpoint._Written())


def _save(d):
    (d / "w").write_text("w")


def _ids(start: int, stop: int) -> tuple[str, ...]:
    return tuple(f"exp-e0-p{i}-a0" for i in range(start, stop))


def _write(root, step: int, ids) -> dict:
    """Checkpoint `step` with `ids`; its state.json as written."""
    path = write_checkpoint(root, CheckpointState("e", step, step, step * B, ids), _save)
    return json.loads((path / STATE_FILE).read_text())


def _logs(root) -> list[str]:
    return sorted(os.listdir(root / IDS_DIR))


def _line(ids) -> int:
    """Bytes of one appended line holding `ids`."""
    return len(json.dumps(list(ids), separators=(",", ":"))) + 1


def test_checkpoint_empty_list_inline_no_log(tmp_path):
    raw = _write(tmp_path, 1, ())
    assert raw["trained_ids"] == [] and "trained_ids_log" not in raw
    assert not (tmp_path / IDS_DIR).exists()
    assert latest_checkpoint(tmp_path)[1] == CheckpointState("e", 1, 1, B, ())


def test_checkpoint_each_step_appends_only_the_new_ids(tmp_path):
    first = 10_000
    raw = _write(tmp_path, 1, _ids(0, first))
    log = raw["trained_ids_log"]
    assert (log["count"], log["last"]) == (first, f"exp-e0-p{first - 1}-a0")
    [name] = _logs(tmp_path)
    for step in (2, 3, 4):
        ids = _ids(0, first + (step - 1) * B)
        before = (tmp_path / IDS_DIR / name).stat().st_size
        raw = _write(tmp_path, step, ids)
        grown = (tmp_path / IDS_DIR / name).stat().st_size - before
        assert grown == _line(ids[-B:])  # one line of the step's ids, not the list again
        assert raw["trained_ids_log"]["file"] == name and _logs(tmp_path) == [name]
        assert raw["trained_ids_log"]["bytes"] == before + grown
        assert latest_checkpoint(tmp_path)[1].trained_ids == ids
    assert "trained_ids" not in raw  # nothing inline


def test_checkpoint_older_kept_checkpoint_reads_its_own_prefix(tmp_path):
    _write(tmp_path, 1, _ids(0, 100))
    p2 = write_checkpoint(tmp_path, CheckpointState("e", 2, 2, 2 * B, _ids(0, 100 + B)), _save)
    _write(tmp_path, 3, _ids(0, 100 + 2 * B))
    assert not (tmp_path / "step_000001").exists()
    assert read_state(p2).trained_ids == _ids(0, 100 + B)  # the log grew after it


def test_checkpoint_after_a_failed_one_cuts_off_what_it_appended(tmp_path, monkeypatch):
    _write(tmp_path, 1, _ids(0, 100))
    replace = os.replace

    def fail_state_rename(src, dst):
        if str(dst).endswith("step_000002"):
            raise OSError("disk full")
        return replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", fail_state_rename)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path, 2, _ids(0, 100 + B))  # its ids were appended, its state.json is not
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    assert latest_checkpoint(tmp_path)[1].trained_ids == _ids(0, 100)
    other = _ids(0, 100) + _ids(5000, 5000 + 3)  # the retried step trained other groups
    raw = _write(tmp_path, 2, other)
    [name] = _logs(tmp_path)
    assert (tmp_path / IDS_DIR / name).stat().st_size == raw["trained_ids_log"]["bytes"]
    assert latest_checkpoint(tmp_path)[1].trained_ids == other


def test_checkpoint_restarted_process_starts_its_own_log_old_one_pruned(tmp_path, monkeypatch):
    _write(tmp_path, 1, _ids(0, 100))
    _write(tmp_path, 2, _ids(0, 100 + B))
    [old] = _logs(tmp_path)
    _restart(monkeypatch)
    resumed = latest_checkpoint(tmp_path)[1].trained_ids  # as a restarted trainer reads it
    assert resumed == _ids(0, 100 + B)
    raw = _write(tmp_path, 3, resumed + _ids(1000, 1000 + B))
    new = raw["trained_ids_log"]["file"]
    assert new != old and _logs(tmp_path) == sorted([old, new])  # step 2 still names the old
    assert raw["trained_ids_log"]["count"] == 100 + 2 * B
    _write(tmp_path, 4, resumed + _ids(1000, 1000 + 2 * B))  # appended to its own log
    assert _logs(tmp_path) == [new]
    assert latest_checkpoint(tmp_path)[1].trained_ids == resumed + _ids(1000, 1000 + 2 * B)


def test_checkpoint_list_not_continuing_previous_starts_new_log(tmp_path):
    _write(tmp_path, 1, _ids(0, 100))
    other = _ids(10**6, 10**6 + 20)  # not a continuation (another lineage)
    raw = _write(tmp_path, 2, other)
    assert raw["trained_ids_log"]["count"] == len(other) and len(_logs(tmp_path)) == 2
    assert latest_checkpoint(tmp_path)[1].trained_ids == other


def test_checkpoint_full_log_starts_new_one_with_the_list(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "LOG_IDS_MAX", 100)
    _write(tmp_path, 1, _ids(0, 60))
    [first] = _logs(tmp_path)
    _write(tmp_path, 2, _ids(0, 100))  # exactly LOG_IDS_MAX: still appended
    assert _logs(tmp_path) == [first]
    window = _ids(20, 120)  # the trainer keeps the newest 100
    raw = _write(tmp_path, 3, window)
    assert raw["trained_ids_log"]["file"] != first and raw["trained_ids_log"]["count"] == 100
    assert latest_checkpoint(tmp_path)[1].trained_ids == window


def test_checkpoint_bounded_window_slides_reads_back_superset_newest_last(tmp_path):
    kept = RecentIds(capacity=100)
    kept.extend(_ids(0, 100))
    _write(tmp_path, 1, kept)
    kept.extend(_ids(100, 100 + B))  # the oldest B forgotten
    _write(tmp_path, 2, kept)  # RecentIds itself, not a copy
    back = latest_checkpoint(tmp_path)[1].trained_ids
    assert back[-100:] == tuple(kept) and back == _ids(0, 100 + B)
    assert list(RecentIds(back, capacity=100)) == list(kept)


def test_checkpoint_ids_of_any_characters_round_trip(tmp_path):
    odd = ("a\nb", 'q"uote', "back\\slash", "uni\u2028code", "")
    _write(tmp_path, 1, odd[:2])
    _write(tmp_path, 2, odd)
    assert latest_checkpoint(tmp_path)[1].trained_ids == odd


def test_checkpoint_log_not_matching_its_state_is_an_error(tmp_path):
    raw = _write(tmp_path, 1, _ids(0, 10))
    (tmp_path / IDS_DIR / raw["trained_ids_log"]["file"]).write_bytes(b'["x"]\n')
    with pytest.raises(ValueError, match="does not hold what its checkpoint names"):
        latest_checkpoint(tmp_path)


def _old_format(root, step: int, **ids_fields) -> None:
    d = root / f"step_{step:06d}"
    (d / "backend").mkdir(parents=True)
    state = {"experiment_id": "e", "step": step, "version": step, "last_seq": step * B}
    (d / STATE_FILE).write_text(json.dumps({**state, **ids_fields}))


def test_checkpoint_written_before_the_log_reads_and_is_continued(tmp_path):
    """Inline lists and base files (the formats before the log) read back whole; the next
    checkpoint starts a log, and the base goes once no kept checkpoint names it."""
    _old_format(tmp_path, 1, trained_ids=list(_ids(0, 5)))
    assert latest_checkpoint(tmp_path)[1].trained_ids == _ids(0, 5)
    (tmp_path / IDS_DIR).mkdir()
    (tmp_path / IDS_DIR / "ids_000002-abc.json").write_text(json.dumps(list(_ids(0, 50))))
    base = {"file": "ids_000002-abc.json", "count": 50, "last": _ids(0, 50)[-1]}
    _old_format(tmp_path, 2, trained_ids_base=base, trained_ids=list(_ids(50, 60)))
    assert latest_checkpoint(tmp_path)[1].trained_ids == _ids(0, 60)
    raw = _write(tmp_path, 3, _ids(0, 60 + B))
    assert raw["trained_ids_log"]["count"] == 60 + B
    assert "ids_000002-abc.json" in _logs(tmp_path)  # step 2 is kept and names it
    _write(tmp_path, 4, _ids(0, 60 + 2 * B))
    assert _logs(tmp_path) == [raw["trained_ids_log"]["file"]]
    assert latest_checkpoint(tmp_path)[1].trained_ids == _ids(0, 60 + 2 * B)


def test_checkpoint_memory_holds_one_root_the_kept_states(tmp_path):
    for step in range(1, 6):
        _write(tmp_path / "a", step, _ids(0, step * B))
    written = checkpoint._WRITTEN
    assert written.root == tmp_path / "a" and sorted(written.states) == [
        "step_000004",
        "step_000005",
    ]
    _write(tmp_path / "b", 1, _ids(0, B))  # another experiment: only its states in memory
    assert written.root == tmp_path / "b" and list(written.states) == ["step_000001"]


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_checkpoint_torn_last_log_line_cut_with_a_log_line(tmp_path, damage):
    from structlog.testing import capture_logs

    _write(tmp_path, 1, _ids(0, 10))
    raw = _write(tmp_path, 2, _ids(0, 10 + B))  # appends one line of B ids to the same log
    log = tmp_path / IDS_DIR / raw["trained_ids_log"]["file"]
    data = log.read_bytes()
    cut = len(data) - _line(_ids(10, 10 + B))  # where step 2's line starts
    if damage == "truncated":  # a power cut mid-append: 7 bytes of the line landed
        log.write_bytes(data[: cut + 7])
    else:  # the line's blocks read back as zeros
        log.write_bytes(data[:cut] + bytes(len(data) - cut))
    with capture_logs() as logs:
        got = latest_checkpoint(tmp_path)
    assert got[0].name == "step_000002" and got[1].trained_ids == _ids(0, 10)
    assert [e for e in logs if e["event"] == "trained_ids_log_torn_line_cut"] == [
        {
            "event": "trained_ids_log_torn_line_cut",
            "log_level": "warning",
            "file": str(log),
            "named": 10 + B,
            "kept": 10,
        }
    ]
    assert read_state(tmp_path / "step_000001").trained_ids == _ids(0, 10)  # its prefix whole


def test_checkpoint_bad_middle_log_line_is_an_error_naming_file_and_line(tmp_path):
    _write(tmp_path, 1, _ids(0, 10))
    raw = _write(tmp_path, 2, _ids(0, 10 + B))
    log = tmp_path / IDS_DIR / raw["trained_ids_log"]["file"]
    log.write_bytes(b"garbage\n" + log.read_bytes().split(b"\n", 1)[1])
    with pytest.raises(ValueError, match=rf"^trained-ids log {log}: line 1 is not a JSON array"):
        latest_checkpoint(tmp_path)


def test_checkpoint_files_fsynced_before_the_rename(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _write(tmp_path, 1, _ids(0, 10))
    (at,) = [i for i, e in enumerate(events) if e[0] == "replace"]
    tmp = events[at][1]
    synced = {path for kind, path in events[:at] if kind == "fsync"}
    assert {f"{tmp}/{STATE_FILE}", f"{tmp}/backend/w", f"{tmp}/backend", tmp} <= synced
    assert any(p.startswith(str(tmp_path / IDS_DIR) + "/ids_") for p in synced)  # the log
    assert ("fsync", str(tmp_path)) in events[at:]  # the rename itself
