"""The trained ids in trainer checkpoints: a checkpoint appends the ids trained since the one it
prunes to that one's log (O(groups per `keep` checkpoints)), so no two kept checkpoints share a
log; what a checkpoint reads back is always the whole list it was given, whatever was appended
or cut off after it, and a damaged log costs its own checkpoint only."""

from __future__ import annotations

import json
import os

import pytest

from services.trainer import checkpoint
from services.trainer.checkpoint import (
    IDS_DIR,
    STATE_FILE,
    CheckpointState,
    Damaged,
    latest_checkpoint,
    read_state,
    resume_point,
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


def test_checkpoint_continues_the_log_of_the_one_it_prunes_appending_only_new_ids(tmp_path):
    first = 10_000
    raw = _write(tmp_path, 1, _ids(0, first))
    log = raw["trained_ids_log"]
    assert (log["count"], log["last"]) == (first, f"exp-e0-p{first - 1}-a0")
    raw = _write(tmp_path, 2, _ids(0, first + B))  # nothing to prune yet: a log of its own
    assert raw["trained_ids_log"]["count"] == first + B
    names = {1: log["file"], 2: raw["trained_ids_log"]["file"]}
    assert names[1] != names[2] and _logs(tmp_path) == sorted(names.values())
    for step in (3, 4, 5):
        ids = _ids(0, first + (step - 1) * B)
        name = names[step - 2]  # the log of the checkpoint this one prunes
        before = (tmp_path / IDS_DIR / name).stat().st_size
        raw = _write(tmp_path, step, ids)
        grown = (tmp_path / IDS_DIR / name).stat().st_size - before
        assert grown == _line(ids[-2 * B :])  # one line: the ids of the last 2 steps
        assert raw["trained_ids_log"] == {
            "file": name,
            "bytes": before + grown,
            "count": len(ids),
            "last": ids[-1],
        }
        names[step] = name
        assert _logs(tmp_path) == sorted({names[step - 1], name})  # one log per kept one
        assert latest_checkpoint(tmp_path)[1].trained_ids == ids
        assert read_state(tmp_path / f"step_{step - 1:06d}").trained_ids == ids[:-B]
    assert "trained_ids" not in raw  # nothing inline


def test_checkpoint_older_kept_checkpoint_reads_its_own_prefix(tmp_path):
    _write(tmp_path, 1, _ids(0, 100))
    p2 = write_checkpoint(tmp_path, CheckpointState("e", 2, 2, 2 * B, _ids(0, 100 + B)), _save)
    _write(tmp_path, 3, _ids(0, 100 + 2 * B))
    assert not (tmp_path / "step_000001").exists()
    assert read_state(p2).trained_ids == _ids(0, 100 + B)  # the log grew after it


def test_checkpoint_after_a_failed_one_cuts_off_what_it_appended(tmp_path, monkeypatch):
    _write(tmp_path, 1, _ids(0, 100))
    _write(tmp_path, 2, _ids(0, 100 + B))
    replace = os.replace

    def fail_state_rename(src, dst):
        if str(dst).endswith("step_000003"):
            raise OSError("disk full")
        return replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", fail_state_rename)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path, 3, _ids(0, 100 + 2 * B))  # appended to step 1's log, no state.json
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    assert read_state(tmp_path / "step_000001").trained_ids == _ids(0, 100)
    other = _ids(0, 100 + B) + _ids(5000, 5000 + 3)  # the retried step trained other groups
    raw = _write(tmp_path, 3, other)
    assert len(_logs(tmp_path)) == 2
    name = raw["trained_ids_log"]["file"]
    assert (tmp_path / IDS_DIR / name).stat().st_size == raw["trained_ids_log"]["bytes"]
    assert latest_checkpoint(tmp_path)[1].trained_ids == other


def test_checkpoint_restarted_process_starts_its_own_logs_old_ones_pruned(tmp_path, monkeypatch):
    _write(tmp_path, 1, _ids(0, 100))
    _write(tmp_path, 2, _ids(0, 100 + B))
    old = _logs(tmp_path)
    _restart(monkeypatch)
    resumed = latest_checkpoint(tmp_path)[1].trained_ids  # as a restarted trainer reads it
    assert resumed == _ids(0, 100 + B)
    raw3 = _write(tmp_path, 3, resumed + _ids(1000, 1000 + B))  # step 1's log is not its own
    new3 = raw3["trained_ids_log"]["file"]
    assert new3 not in old and raw3["trained_ids_log"]["count"] == 100 + 2 * B
    raw4 = _write(tmp_path, 4, resumed + _ids(1000, 1000 + 2 * B))
    new4 = raw4["trained_ids_log"]["file"]
    assert _logs(tmp_path) == sorted([new3, new4])  # steps 1, 2 pruned with their logs
    _write(tmp_path, 5, resumed + _ids(1000, 1000 + 3 * B))  # appended to its own: step 3's
    assert _logs(tmp_path) == sorted([new3, new4])
    assert latest_checkpoint(tmp_path)[1].trained_ids == resumed + _ids(1000, 1000 + 3 * B)


def test_checkpoint_list_not_continuing_previous_starts_new_log(tmp_path):
    _write(tmp_path, 1, _ids(0, 100))
    _write(tmp_path, 2, _ids(0, 100 + B))
    other = _ids(10**6, 10**6 + 20)  # not a continuation (another lineage)
    raw = _write(tmp_path, 3, other)
    assert raw["trained_ids_log"]["count"] == len(other) and len(_logs(tmp_path)) == 2
    assert latest_checkpoint(tmp_path)[1].trained_ids == other


def test_checkpoint_full_log_starts_new_one_with_the_list(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "LOG_IDS_MAX", 100)
    first = _write(tmp_path, 1, _ids(0, 60))["trained_ids_log"]["file"]
    _write(tmp_path, 2, _ids(0, 70))
    raw = _write(tmp_path, 3, _ids(0, 100))  # exactly LOG_IDS_MAX in step 1's: appended
    assert raw["trained_ids_log"]["file"] == first
    window = _ids(20, 120)  # the trainer keeps the newest 100; step 2's log would hold 120
    raw = _write(tmp_path, 4, window)
    assert raw["trained_ids_log"]["count"] == 100 and len(_logs(tmp_path)) == 2
    assert latest_checkpoint(tmp_path)[1].trained_ids == window


def test_checkpoint_bounded_window_slides_reads_back_superset_newest_last(tmp_path):
    kept = RecentIds(capacity=100)
    kept.extend(_ids(0, 100))
    _write(tmp_path, 1, kept)
    kept.extend(_ids(100, 100 + B))  # the oldest B forgotten
    _write(tmp_path, 2, kept)  # RecentIds itself, not a copy; a log of its own: the window
    assert latest_checkpoint(tmp_path)[1].trained_ids == tuple(kept)
    kept.extend(_ids(100 + B, 100 + 2 * B))
    _write(tmp_path, 3, kept)  # continues step 1's log
    back = latest_checkpoint(tmp_path)[1].trained_ids
    assert back[-100:] == tuple(kept) and back == _ids(0, 100 + 2 * B)
    assert list(RecentIds(back, capacity=100)) == list(kept)


def test_checkpoint_ids_of_any_characters_round_trip(tmp_path):
    odd = ("a\nb", 'q"uote', "back\\slash", "uni\u2028code", "")
    _write(tmp_path, 1, odd[:2])
    _write(tmp_path, 2, odd)
    assert latest_checkpoint(tmp_path)[1].trained_ids == odd


def test_checkpoint_log_not_matching_its_state_is_damage_naming_the_log(tmp_path):
    raw = _write(tmp_path, 1, _ids(0, 10))
    log = tmp_path / IDS_DIR / raw["trained_ids_log"]["file"]
    log.write_bytes(b'["x"]\n')
    with pytest.raises(Damaged, match=r"^trained-ids log holds 6 bytes, its checkpoint names") as e:
        latest_checkpoint(tmp_path)
    assert e.value.file == log
    log.write_bytes(b'["x"' + b" " * (raw["trained_ids_log"]["bytes"] - 6) + b"]\n")
    with pytest.raises(Damaged, match=r"^trained-ids log does not hold what its checkpoint names"):
        latest_checkpoint(tmp_path)  # as many bytes, not the ids


def _old_format(root, step: int, **ids_fields) -> None:
    d = root / f"step_{step:06d}"
    (d / "backend").mkdir(parents=True)
    state = {"experiment_id": "e", "step": step, "version": step, "last_seq": step * B}
    (d / STATE_FILE).write_text(json.dumps({**state, **ids_fields}))


def test_checkpoint_written_before_the_log_reads_and_is_continued(tmp_path):
    """Inline lists and base files (the formats before the log) read back whole; the next
    checkpoints start logs, and the base goes once no kept checkpoint names it."""
    _old_format(tmp_path, 1, trained_ids=list(_ids(0, 5)))
    assert latest_checkpoint(tmp_path)[1].trained_ids == _ids(0, 5)
    (tmp_path / IDS_DIR).mkdir()
    (tmp_path / IDS_DIR / "ids_000002-abc.json").write_text(json.dumps(list(_ids(0, 50))))
    base = {"file": "ids_000002-abc.json", "count": 50, "last": _ids(0, 50)[-1]}
    _old_format(tmp_path, 2, trained_ids_base=base, trained_ids=list(_ids(50, 60)))
    assert latest_checkpoint(tmp_path)[1].trained_ids == _ids(0, 60)
    raw3 = _write(tmp_path, 3, _ids(0, 60 + B))
    assert raw3["trained_ids_log"]["count"] == 60 + B
    assert "ids_000002-abc.json" in _logs(tmp_path)  # step 2 is kept and names it
    raw4 = _write(tmp_path, 4, _ids(0, 60 + 2 * B))
    assert _logs(tmp_path) == sorted(r["trained_ids_log"]["file"] for r in (raw3, raw4))
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
def test_checkpoint_torn_log_sets_its_checkpoint_aside_the_older_one_whole(tmp_path, damage):
    from structlog.testing import capture_logs

    _write(tmp_path, 1, _ids(0, 10))
    raw = _write(tmp_path, 2, _ids(0, 10 + B))  # a log of its own: step 1's is not touched
    log = tmp_path / IDS_DIR / raw["trained_ids_log"]["file"]
    data = log.read_bytes()
    if damage == "truncated":  # the file cut 7 bytes into its last line
        log.write_bytes(data[: len(data) - _line(_ids(10, 10 + B)) + 7])
    else:  # its last blocks read back as zeros
        log.write_bytes(data[:64] + bytes(len(data) - 64))
    with pytest.raises(Damaged) as e:
        latest_checkpoint(tmp_path)
    assert e.value.file == log
    with capture_logs() as logs:
        got = resume_point(tmp_path)
    assert got[0].name == "step_000001" and got[1].trained_ids == _ids(0, 10)
    [event] = [e for e in logs if e["event"] == "checkpoint_set_aside"]
    assert (event["file"], event["log_level"]) == (str(log), "error")
    [aside] = os.listdir(tmp_path / "damaged")
    assert event["moved_to"] == str(tmp_path / "damaged" / aside)
    assert aside.startswith("step_000002-") and not (tmp_path / "step_000002").exists()


def test_checkpoint_bad_middle_log_line_is_damage_naming_file_and_line(tmp_path):
    _write(tmp_path, 1, _ids(0, 10))
    _write(tmp_path, 2, _ids(0, 10 + B))
    raw = _write(tmp_path, 3, _ids(0, 10 + 2 * B))  # two lines in step 1's log
    log = tmp_path / IDS_DIR / raw["trained_ids_log"]["file"]
    first, rest = log.read_bytes().split(b"\n", 1)
    log.write_bytes(b"g".ljust(len(first), b"x") + b"\n" + rest)
    with pytest.raises(Damaged, match=r"^trained-ids log line 1 is not a JSON array") as e:
        latest_checkpoint(tmp_path)
    assert e.value.file == log


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
