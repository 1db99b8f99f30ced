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

A checkpoint writes only the ids trained since the previous one: the list lives in an
append-only *log* under `<root>/trained_ids/`, one JSON array of ids per line, and state.json
names the log and how much of it is this checkpoint's (`trained_ids_log`: file, bytes, count,
last id). A step appends its ids as one line and writes a state.json naming the longer prefix,
so it costs O(groups per step), never O(the list). The prefix a complete checkpoint names is
never changed: a process appends only to a log it created itself, after the prefix the newest
checkpoint names (cutting off what a failed checkpoint appended beyond it). A new log, holding
the whole list, is started by a process's first checkpoint, by a list that does not continue
the newest checkpoint's, and once a log holds `LOG_IDS_MAX` ids. A log no kept checkpoint
names is deleted with the checkpoints. (Checkpoints written before the log read as before: the
whole list inline in `trained_ids`, or a `trained_ids_base` file plus the ids since.)
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from asyncrl.logging import get_logger

STATE_FILE = "state.json"
BACKEND_DIR = "backend"
PREFIX = "step_"
IDS_DIR = "trained_ids"
LOG_IDS_MAX = 200_000
"""Ids a trained-ids log holds at most; the next checkpoint starts a new one (with the list)."""


@dataclass(frozen=True)
class CheckpointState:
    experiment_id: str
    step: int
    """Optimizer steps taken."""
    version: int
    """Policy version of the checkpointed weights."""
    last_seq: int
    """Stream sequence of the last consumed message (0: nothing consumed yet)."""
    trained_ids: Sequence[str] = ()
    """Group ids trained up to this checkpoint, oldest first (bounded by the trainer). Read
    back as a tuple; written from any sequence that `reversed` walks from the newest (the
    trainer's `RecentIds`, not copied: it must not change while `write_checkpoint` runs)."""


def checkpoint_root(var_dir: Path, experiment_id: str) -> Path:
    return Path(var_dir) / "checkpoints" / experiment_id


def consumer_start_seq(state: CheckpointState | None) -> int:
    """First stream sequence the trainer's consumer delivers: right after the checkpoint."""
    return state.last_seq + 1 if state else 1


def _step_dirs(root: Path) -> list[Path]:
    """The complete checkpoints under `root`, oldest first."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    names = sorted(
        e.name
        for e in entries
        if e.name.startswith(PREFIX) and e.is_dir() and os.path.isfile(f"{e.path}/{STATE_FILE}")
    )
    return [root / name for name in names]


def _raw_state(ckpt_dir: Path) -> dict:
    return json.loads((Path(ckpt_dir) / STATE_FILE).read_text())


def _log_ids(root: Path, log: dict) -> list[str]:
    """The ids of the log prefix `log` names. A torn last line (the file ends inside it: an
    append a power cut interrupted) is cut with a log line, losing only that line's ids."""
    path = root / IDS_DIR / log["file"]
    with open(path, "rb") as f:
        data = f.read(log["bytes"])
    complete, _, tail = data.rpartition(b"\n")
    if tail:  # a named prefix ends with a newline: this line was torn (or zeroed)
        ids = _lines_ids(path, complete)
        get_logger().warning(
            "trained_ids_log_torn_line_cut", file=str(path), named=log["count"], kept=len(ids)
        )
        return ids
    ids = _lines_ids(path, data)
    if len(data) != log["bytes"] or len(ids) != log["count"]:
        raise ValueError(f"trained-ids log {path} does not hold what its checkpoint names")
    return ids


def _lines_ids(path: Path, data: bytes) -> list[str]:
    """The ids of complete lines (each a JSON array); ValueError naming the file and line."""
    ids: list[str] = []
    for n, line in enumerate(data.splitlines(), start=1):
        try:
            ids.extend(json.loads(line))
        except ValueError as e:
            raise ValueError(f"trained-ids log {path}: line {n} is not a JSON array: {e}") from e
    return ids


def _stored_ids(root: Path, raw: dict) -> list[str]:
    """The trained ids a state.json names, in any of the formats written over time."""
    if raw.get("trained_ids_log"):
        return _log_ids(root, raw["trained_ids_log"])
    base = raw.get("trained_ids_base")  # before the log: a base file + the ids since
    older = json.loads((root / IDS_DIR / base["file"]).read_text()) if base else []
    return older + raw.get("trained_ids", [])  # absent before ids were kept


def read_state(ckpt_dir: Path) -> CheckpointState:
    raw = _raw_state(ckpt_dir)
    ids = _stored_ids(Path(ckpt_dir).parent, raw)
    names = {f.name for f in fields(CheckpointState)} - {"trained_ids"}
    return CheckpointState(**{k: raw[k] for k in names if k in raw}, trained_ids=tuple(ids))


def latest_checkpoint(root: Path) -> tuple[Path, CheckpointState] | None:
    """The newest complete checkpoint under `root`, or None."""
    dirs = _step_dirs(Path(root))
    if not dirs:
        return None
    return dirs[-1], read_state(dirs[-1])


def _after(ids: Sequence[str], last: str) -> list[str] | None:
    """The ids of `ids` after `last`, or None when `last` is not among them. From the newest
    back: the new ids are few (an id is trained once, so `last` is there at most once)."""
    new = []
    for i in reversed(ids):
        if i == last:
            new.reverse()
            return new
        new.append(i)
    return None


@dataclass
class _Written:
    """What this process wrote under the root it last wrote to: the states of the checkpoints
    still kept, by step directory name (the next checkpoint continues the newest, and pruning
    reads the logs they name, without reading them back: a complete checkpoint is never
    changed), and the logs it created (the only ones it appends to). One root: a trainer
    checkpoints one experiment at a time, and a finished one's are not kept in memory."""

    root: Path | None = None
    states: dict[str, dict] = field(default_factory=dict)
    logs: set[str] = field(default_factory=set)

    def at(self, root: Path) -> _Written:
        if root != self.root:
            self.root, self.states, self.logs = root, {}, set()
        return self


_WRITTEN = _Written()


def _read(root: Path, ckpt_dir: Path) -> dict:
    """`ckpt_dir`'s state: as this process wrote it, else from its state.json."""
    written = _WRITTEN.at(root).states.get(ckpt_dir.name)
    return written if written is not None else _raw_state(ckpt_dir)


def _append_ids(root: Path, ids: Sequence[str], prev: dict | None) -> dict | None:
    """Append to the log the newest checkpoint `prev` names the ids of `ids` after its prefix,
    when that log is this process's own and `ids` continue its prefix; the new `trained_ids_log`
    field, or None (a new log is needed)."""
    log = (prev or {}).get("trained_ids_log")
    if not log or log["file"] not in _WRITTEN.at(root).logs:
        return None
    new = _after(ids, log["last"])
    if new is None or log["count"] + len(new) > LOG_IDS_MAX:
        return None
    data = json.dumps(new, separators=(",", ":")).encode() + b"\n" if new else b""
    with open(root / IDS_DIR / log["file"], "r+b") as f:
        f.seek(log["bytes"])  # past the prefix: what a failed checkpoint appended is cut off
        f.write(data)
        f.truncate()
        os.fsync(f.fileno())  # the state.json naming this prefix is written after it
    return {
        **log,
        "bytes": log["bytes"] + len(data),
        "count": log["count"] + len(new),
        "last": new[-1] if new else log["last"],
    }


def _new_log(root: Path, step: int, ids: Sequence[str]) -> dict:
    """A new log of this process holding `ids`; its `trained_ids_log` field."""
    name = f"ids_{step:06d}-{uuid.uuid4().hex[:8]}.log"
    ids = list(ids)
    data = json.dumps(ids, separators=(",", ":")).encode() + b"\n"
    (root / IDS_DIR).mkdir(parents=True, exist_ok=True)
    with open(root / IDS_DIR / name, "wb") as f:  # named by no checkpoint until state.json is
        f.write(data)
        os.fsync(f.fileno())
    _fsync_dir(root / IDS_DIR)
    _WRITTEN.at(root).logs.add(name)
    return {"file": name, "bytes": len(data), "count": len(ids), "last": ids[-1]}


def _state(root: Path, state: CheckpointState, latest: list[Path]) -> dict:
    """`state` as its state.json holds it (the ids appended to a log first)."""
    raw = {f.name: getattr(state, f.name) for f in fields(state) if f.name != "trained_ids"}
    ids = state.trained_ids
    if not ids:
        return {**raw, "trained_ids": []}
    try:
        prev = _read(root, latest[-1]) if latest else None
    except (OSError, ValueError):
        prev = None  # unreadable: this checkpoint starts a log of its own
    log = _append_ids(root, ids, prev) or _new_log(root, state.step, ids)
    return {**raw, "trained_ids_log": log}


def _prune(root: Path, kept: list[Path]) -> None:
    """Delete the checkpoints not `kept`, and the logs (and older base files) they name."""
    written = _WRITTEN.at(root)
    for name in set(written.states) - {d.name for d in kept}:
        del written.states[name]
    named = set()
    for d in kept:
        try:
            raw = _read(root, d)
        except (OSError, ValueError):
            return  # a checkpoint being pruned concurrently: keep every log this time
        named.add((raw.get("trained_ids_log") or raw.get("trained_ids_base") or {}).get("file"))
    try:
        files = os.listdir(root / IDS_DIR)
    except FileNotFoundError:
        return
    for name in files:
        if name not in named:
            (root / IDS_DIR / name).unlink(missing_ok=True)
            written.logs.discard(name)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    """fsync every file under `top`, then each directory (their entries)."""
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


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
    latest = _step_dirs(root)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        (tmp / BACKEND_DIR).mkdir(parents=True)
        save_backend(tmp / BACKEND_DIR)
        raw = _state(root, state, latest)
        (tmp / STATE_FILE).write_text(json.dumps(raw, separators=(",", ":")))
        _fsync_tree(tmp)  # on disk before the name says complete (a power cut leaves zeros)
        if final.exists():  # a leftover without state.json: incomplete, never readable
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _WRITTEN.at(root).states[final.name] = raw
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    complete = sorted({*latest, final}, key=lambda p: p.name)
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    _prune(root, complete[-keep:])
    return final
