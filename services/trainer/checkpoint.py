"""Trainer checkpoints: backend state + step/version + the consumer position, written atomically.

Layout: <var>/checkpoints/<experiment>/step_<NNNNNN>/ with `state.json` (this module) and
`backend/` (whatever `TrainerBackend.save_checkpoint` writes). A checkpoint is written to a
temporary sibling and renamed into place, so a directory named `step_*` is always complete.

The consumer position is the stream sequence of the last message consumed at a step boundary
(every message up to it was trained or dropped). Resuming re-creates the trainer's consumer at
`last_seq + 1`: groups consumed after the checkpoint are trained again (their effect was lost
with the process) and nothing before it is. Messages the trainer fetched but had not yet taken
into a step lie after that position, so they are delivered again too.

The ids of the groups trained up to the checkpoint (the newest `TRAINED_IDS_KEPT`) are part of
the state, so a replayed group (the same group id on the stream again) is recognised after a
restart; ids trained after the checkpoint are forgotten with the steps that trained them.

A checkpoint writes only the ids trained since the previous one, not the whole list (up to
100 k ids, 4 MB of JSON, every step). While the list has at most `INLINE_IDS` ids, state.json
holds all of them (`trained_ids`). Beyond that, state.json names a *base*: an immutable file
under `<root>/trained_ids/` with the list as it was at some earlier checkpoint, and holds only
the ids trained since (`trained_ids`, oldest first, at most `INLINE_IDS`). When that tail would
grow past `INLINE_IDS`, the checkpoint writes a new base with the whole list instead. So a step
writes O(groups since the last base), and the whole list once every `INLINE_IDS` groups. A base
no kept checkpoint names is deleted with the checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

STATE_FILE = "state.json"
BACKEND_DIR = "backend"
PREFIX = "step_"
IDS_DIR = "trained_ids"
INLINE_IDS = 4096
"""Trained ids a state.json holds at most; beyond, a base file holds the older ones."""


@dataclass(frozen=True)
class CheckpointState:
    experiment_id: str
    step: int
    """Optimizer steps taken."""
    version: int
    """Policy version of the checkpointed weights."""
    last_seq: int
    """Stream sequence of the last consumed message (0: nothing consumed yet)."""
    trained_ids: tuple[str, ...] = ()
    """Group ids trained up to this checkpoint, oldest first (bounded by the trainer)."""


def checkpoint_root(var_dir: Path, experiment_id: str) -> Path:
    return Path(var_dir) / "checkpoints" / experiment_id


def consumer_start_seq(state: CheckpointState | None) -> int:
    """First stream sequence the trainer's consumer delivers: right after the checkpoint."""
    return state.last_seq + 1 if state else 1


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted((p for p in dirs if (p / STATE_FILE).is_file()), key=lambda p: p.name)


def _raw_state(ckpt_dir: Path) -> dict:
    return json.loads((Path(ckpt_dir) / STATE_FILE).read_text())


def _base_ids(root: Path, base: dict | None) -> list[str]:
    if not base:
        return []
    return json.loads((root / IDS_DIR / base["file"]).read_text())


def read_state(ckpt_dir: Path) -> CheckpointState:
    raw = _raw_state(ckpt_dir)
    base = raw.pop("trained_ids_base", None)
    tail = raw.get("trained_ids", ())  # absent before ids were kept
    raw["trained_ids"] = tuple(_base_ids(Path(ckpt_dir).parent, base)) + tuple(tail)
    return CheckpointState(**raw)


def latest_checkpoint(root: Path) -> tuple[Path, CheckpointState] | None:
    """The newest complete checkpoint under `root`, or None."""
    dirs = _step_dirs(Path(root))
    if not dirs:
        return None
    return dirs[-1], read_state(dirs[-1])


def _new_ids(ids: tuple[str, ...], prev: dict) -> list[str] | None:
    """The ids of `ids` after those the previous checkpoint's state `prev` (one with a base)
    holds: its tail, or its base's last id, must come just before them. None when `ids` does
    not continue `prev`."""
    tail = prev["trained_ids"]
    last = tail[-1] if tail else prev["trained_ids_base"]["last"]
    for i in range(len(ids) - 1, -1, -1):  # from the end: the new ids are few
        if ids[i] == last:
            if list(ids[max(0, i + 1 - len(tail)) : i + 1]) != tail:
                return None
            return list(ids[i + 1 :])
    return None


def _ids_fields(root: Path, state: CheckpointState, prev: dict | None) -> dict:
    """The trained-id fields of `state`'s state.json: the whole list while it is short, else a
    base file and the ids since it, written only when the tail would grow past INLINE_IDS."""
    ids = state.trained_ids
    if len(ids) <= INLINE_IDS:
        return {"trained_ids": list(ids)}
    if prev is not None and prev.get("trained_ids_base"):
        new = _new_ids(ids, prev)
        if new is not None and len(prev["trained_ids"]) + len(new) <= INLINE_IDS:
            return {
                "trained_ids_base": prev["trained_ids_base"],
                "trained_ids": prev["trained_ids"] + new,
            }
    name = f"ids_{state.step:06d}-{uuid.uuid4().hex[:8]}.json"
    (root / IDS_DIR).mkdir(parents=True, exist_ok=True)
    tmp = root / IDS_DIR / f".tmp-{name}"
    tmp.write_text(json.dumps(list(ids), separators=(",", ":")))
    os.replace(tmp, root / IDS_DIR / name)
    return {
        "trained_ids_base": {"file": name, "count": len(ids), "last": ids[-1]},
        "trained_ids": [],
    }


_WRITTEN: dict[Path, dict[str, dict]] = {}
"""The states this process wrote under the root it last wrote to that are still kept, by step
directory name: the next checkpoint continues the newest, and pruning reads the base files they
name, without reading them back (a complete checkpoint is never changed). One root: a trainer
checkpoints one experiment at a time, and a finished one's states are not kept in memory."""


def _read(root: Path, ckpt_dir: Path) -> dict:
    """`ckpt_dir`'s state: as this process wrote it, else from its state.json."""
    written = _WRITTEN.get(root, {}).get(ckpt_dir.name)
    return written if written is not None else _raw_state(ckpt_dir)


def _state(root: Path, state: CheckpointState) -> dict:
    latest = _step_dirs(root)
    try:
        prev = _read(root, latest[-1]) if latest else None
    except (OSError, ValueError):
        prev = None  # unreadable: this checkpoint writes a base of its own
    raw = {f.name: getattr(state, f.name) for f in fields(state) if f.name != "trained_ids"}
    return {**raw, **_ids_fields(root, state, prev)}


def _prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints and the base files they name."""
    for old in _step_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    kept = _step_dirs(root)
    written = _WRITTEN.get(root, {})
    for name in set(written) - {d.name for d in kept}:
        del written[name]
    ids_dir = root / IDS_DIR
    if not ids_dir.is_dir():
        return
    named = set()
    for d in kept:
        try:
            named.add((_read(root, d).get("trained_ids_base") or {}).get("file"))
        except (OSError, ValueError):
            return  # a checkpoint being pruned concurrently: keep every base this time
    for f in ids_dir.iterdir():
        if f.name not in named:
            f.unlink(missing_ok=True)


def write_checkpoint(
    root: Path,
    state: CheckpointState,
    save_backend: Callable[[Path], None],
    keep: int = 2,
) -> Path:
    """Write `state` and the backend state as step_<NNNNNN> atomically; keep the newest `keep`.

    A checkpoint of a step that already exists is left as it is: at a step boundary the state
    is a function of the step, so it would be identical.
    """
    root = Path(root)
    final = root / f"{PREFIX}{state.step:06d}"
    if (final / STATE_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        (tmp / BACKEND_DIR).mkdir(parents=True)
        save_backend(tmp / BACKEND_DIR)
        raw = _state(root, state)
        (tmp / STATE_FILE).write_text(json.dumps(raw, separators=(",", ":")))
        if final.exists():  # a leftover without state.json: incomplete, never readable
            shutil.rmtree(final)
        os.replace(tmp, final)
        if root not in _WRITTEN:
            _WRITTEN.clear()
        _WRITTEN.setdefault(root, {})[final.name] = raw
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep)
    return final
