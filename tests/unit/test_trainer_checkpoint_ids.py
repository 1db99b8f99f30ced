"""The trained ids in trainer checkpoints: a step writes the ids trained since the last base,
not the whole list; what a checkpoint reads back is always the whole list it was given."""

from __future__ import annotations

import json

from services.trainer.checkpoint import (
    IDS_DIR,
    INLINE_IDS,
    STATE_FILE,
    CheckpointState,
    latest_checkpoint,
    write_checkpoint,
)

B = 32


def _save(d):
    (d / "w").write_text("w")


def _ids(start: int, stop: int) -> tuple[str, ...]:
    return tuple(f"exp-e0-p{i}-a0" for i in range(start, stop))


def _write(root, step: int, ids: tuple[str, ...]) -> dict:
    """Checkpoint `step` with `ids`; its state.json as written."""
    path = write_checkpoint(root, CheckpointState("e", step, step, step * B, ids), _save)
    return json.loads((path / STATE_FILE).read_text())


def _bases(root) -> list[str]:
    return sorted(p.name for p in (root / IDS_DIR).iterdir())


def test_checkpoint_short_list_inline_no_base(tmp_path):
    raw = _write(tmp_path, 1, _ids(0, 100))
    assert raw["trained_ids"] == list(_ids(0, 100)) and "trained_ids_base" not in raw
    assert not (tmp_path / IDS_DIR).exists()


def test_checkpoint_long_list_each_step_writes_only_new_ids(tmp_path):
    first = INLINE_IDS + 100
    raw = _write(tmp_path, 1, _ids(0, first))
    assert raw["trained_ids"] == [] and raw["trained_ids_base"]["count"] == first
    [base] = _bases(tmp_path)
    for step in (2, 3, 4):
        ids = _ids(0, first + (step - 1) * B)
        raw = _write(tmp_path, step, ids)
        assert raw["trained_ids"] == list(ids[first:])  # only what came after the base
        assert _bases(tmp_path) == [base]
        assert latest_checkpoint(tmp_path)[1].trained_ids == ids


def test_checkpoint_tail_past_inline_writes_new_base_old_one_pruned(tmp_path):
    n = INLINE_IDS + 1
    _write(tmp_path, 1, _ids(0, n))
    [old] = _bases(tmp_path)
    _write(tmp_path, 2, _ids(0, n + INLINE_IDS))  # a tail of exactly INLINE_IDS: still inline
    assert _bases(tmp_path) == [old]
    raw = _write(tmp_path, 3, _ids(0, n + INLINE_IDS + 1))
    assert raw["trained_ids"] == [] and raw["trained_ids_base"]["file"] != old
    assert _bases(tmp_path) == [old, raw["trained_ids_base"]["file"]]  # step 2 still names old
    _write(tmp_path, 4, _ids(0, n + INLINE_IDS + 2))
    assert _bases(tmp_path) == [raw["trained_ids_base"]["file"]]
    assert latest_checkpoint(tmp_path)[1].trained_ids == _ids(0, n + INLINE_IDS + 2)


def test_checkpoint_bounded_window_slides_reads_back_superset_newest_last(tmp_path):
    window = INLINE_IDS * 2
    _write(tmp_path, 1, _ids(0, window))
    ids = _ids(B, window + B)  # the trainer forgot the oldest B
    raw = _write(tmp_path, 2, ids)
    assert raw["trained_ids"] == list(_ids(window, window + B))
    back = latest_checkpoint(tmp_path)[1].trained_ids
    assert back[-window:] == ids  # the oldest beyond the window are dropped when read


def test_checkpoint_list_not_continuing_previous_writes_new_base(tmp_path):
    _write(tmp_path, 1, _ids(0, INLINE_IDS + 10))
    other = _ids(10**6, 10**6 + INLINE_IDS + 20)  # not a continuation (another lineage)
    raw = _write(tmp_path, 2, other)
    assert raw["trained_ids"] == [] and raw["trained_ids_base"]["count"] == len(other)
    assert latest_checkpoint(tmp_path)[1].trained_ids == other


def test_checkpoint_resumed_list_continues_from_read_state(tmp_path):
    _write(tmp_path, 1, _ids(0, INLINE_IDS + 10))
    _write(tmp_path, 2, _ids(0, INLINE_IDS + 10 + B))
    resumed = latest_checkpoint(tmp_path)[1].trained_ids  # as a restarted trainer reads it
    raw = _write(tmp_path, 3, resumed + _ids(INLINE_IDS + 10 + B, INLINE_IDS + 10 + 2 * B))
    assert raw["trained_ids"] == list(_ids(INLINE_IDS + 10, INLINE_IDS + 10 + 2 * B))
    assert len(_bases(tmp_path)) == 1


def test_checkpoint_continued_from_memory_writes_what_a_read_back_would(tmp_path, monkeypatch):
    """A trainer continues the state it wrote last without reading it back; a restarted one
    (nothing in memory) reads it: both write the same state.json at every step."""
    from services.trainer import checkpoint

    read = []
    raw_state = checkpoint._raw_state
    monkeypatch.setattr(checkpoint, "_raw_state", lambda d: read.append(d.parent) or raw_state(d))
    steps = range(1, 2 * INLINE_IDS // B + 3)  # past a new base
    kept, fresh, memory = tmp_path / "kept", tmp_path / "fresh", {}
    for step in steps:
        ids = _ids(0, INLINE_IDS + step * B)
        monkeypatch.setattr(checkpoint, "_WRITTEN", memory)
        from_memory = _write(kept, step, ids)
        monkeypatch.setattr(checkpoint, "_WRITTEN", {})  # as after a restart
        read_back = _write(fresh, step, ids)
        base = from_memory.pop("trained_ids_base", None)
        assert base is not None and read_back.pop("trained_ids_base")["count"] == base["count"]
        assert from_memory == read_back  # (a base's file name differs: uuid)
    assert kept not in read and fresh in read  # never read back, once written here
    assert latest_checkpoint(kept)[1].trained_ids == ids
    assert set(memory) == {kept} and len(memory[kept]) == 2  # the kept checkpoints' states
    monkeypatch.setattr(checkpoint, "_WRITTEN", memory)
    _write(tmp_path / "next", 1, _ids(0, B))  # another experiment: only its states in memory
    assert set(memory) == {tmp_path / "next"}
