"""Trainer checkpoints: backend state + step/version + the consumer position, written atomically.

Layout: <var>/checkpoints/<experiment>/step_<NNNNNN>/ with `state.json` (this module),
`backend/` (whatever `TrainerBackend.save_checkpoint` writes) and `manifest.json` (the size and
sha256 of every other file in it). A checkpoint is written to a temporary sibling, each file
fsynced, and renamed into place, so a directory named `step_*` is always complete.

Resuming (`resume_point`) verifies the newest checkpoint against its manifest and its trained
ids against what its state.json names; a damaged one (garbage in a file, a zeroed or truncated
one: what a disk or a power cut leaves) is set aside, moved under `<root>/damaged/` with a log
line naming the file and the reason, and the next older one is tried. Resuming from an older
checkpoint is a deeper rewind, nothing else: the groups trained after it come again.

The consumer position is the stream sequence of the last message consumed at a step boundary
(every message up to it was trained or dropped). Resuming re-creates the trainer's consumer at
`last_seq + 1`: groups consumed after the checkpoint are trained again (their effect was lost
with the process) and nothing before it is. Messages the trainer fetched but had not yet taken
into a step lie after that position, so they are delivered again too.

The ids of the groups trained up to the checkpoint (the newest `TRAINED_IDS_KEPT`) are part of
the state, so a replayed group (the same group id on the stream again) is recognised after a
restart; ids trained after the checkpoint are forgotten with the steps that trained them.

The list lives in append-only *logs* under `<root>/trained_ids/`, one JSON array of ids per
line, and state.json names a log and how much of it is this checkpoint's (`trained_ids_log`:
file, bytes, count, last id). No two kept checkpoints name the same log, so a damaged log costs
one checkpoint, never all: a checkpoint continues the log of the checkpoint it is about to
prune (the `keep`-th newest), appending the ids trained since that one as one line, so a
checkpoint costs O(groups per `keep` checkpoints), never O(the list). The prefix a complete
checkpoint names is never changed: a process appends only to a log it created itself, after
the prefix that checkpoint names (cutting off what a failed checkpoint appended beyond it). A
new log, holding the whole list, is started when there is no such checkpoint (a process's first
`keep` checkpoints), by a list that does not continue its list, and once a log holds
`LOG_IDS_MAX` ids. A log no kept checkpoint names is deleted with the checkpoints.
(Checkpoints written before the log read as before: the whole list inline in `trained_ids`, or
a `trained_ids_base` file plus the ids since; those written before manifests are not verified.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from asyncrl.logging import get_logger

STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
BACKEND_DIR = "backend"
PREFIX = "step_"
IDS_DIR = "trained_ids"
DAMAGED_DIR = "damaged"
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


class Damaged(ValueError):
    """A checkpoint that does not read back as written; `file` is the damaged file."""

    def __init__(self, file: Path, reason: str):
        super().__init__(reason)
        self.file, self.reason = Path(file), reason


def _raw_state(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / STATE_FILE
    try:
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise Damaged(path, f"unreadable state: {type(e).__name__}: {e}") from e
    if not isinstance(raw, dict):
        raise Damaged(path, f"unreadable state: a JSON {type(raw).__name__}, not an object")
    return raw


def _log_ids(root: Path, log: dict) -> list[str]:
    """The ids of the log prefix `log` names; Damaged when the log holds anything else (a
    prefix a complete checkpoint names was fsynced before it was named: a torn or zeroed line
    in it is damage, like a shorter file)."""
    path = root / IDS_DIR / log["file"]
    with open(path, "rb") as f:
        data = f.read(log["bytes"])
    if len(data) != log["bytes"]:
        raise Damaged(
            path, f"trained-ids log holds {len(data)} bytes, its checkpoint names {log['bytes']}"
        )
    ids: list[str] = []
    for n, line in enumerate(data.split(b"\n")[:-1], start=1):
        try:
            ids.extend(json.loads(line))
        except ValueError as e:
            raise Damaged(path, f"trained-ids log line {n} is not a JSON array: {e}") from e
    if not data.endswith(b"\n") or len(ids) != log["count"] or ids[-1:] != [log["last"]]:
        raise Damaged(path, "trained-ids log does not hold what its checkpoint names")
    return ids


def _stored_ids(root: Path, raw: dict) -> list[str]:
    """The trained ids a state.json names, in any of the formats written over time."""
    if raw.get("trained_ids_log"):
        return _log_ids(root, raw["trained_ids_log"])
    base = raw.get("trained_ids_base")  # before the log: a base file + the ids since
    older = json.loads((root / IDS_DIR / base["file"]).read_text()) if base else []
    return older + raw.get("trained_ids", [])  # absent before ids were kept


def _digest(path: Path) -> dict:
    with open(path, "rb") as f:
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": _sha256(f)}


def _sha256(f) -> str:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _verify_files(ckpt_dir: Path) -> None:
    """Every file the manifest lists has the size and sha256 it lists; Damaged naming the first
    that does not. A checkpoint written before manifests (its state.json names none) is not
    checked."""
    path = ckpt_dir / MANIFEST_FILE
    try:
        listed = json.loads(path.read_bytes())["files"]
    except FileNotFoundError:
        if "manifest" in _raw_state(ckpt_dir):
            raise Damaged(path, "missing manifest") from None
        return
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Damaged(path, f"unreadable manifest: {type(e).__name__}: {e}") from e
    for name, want in sorted(listed.items()):
        try:
            got = _digest(ckpt_dir / name)
        except OSError as e:
            raise Damaged(ckpt_dir / name, f"unreadable: {type(e).__name__}: {e}") from e
        if got["bytes"] != want["bytes"]:
            raise Damaged(
                ckpt_dir / name, f"{got['bytes']} bytes, the manifest says {want['bytes']}"
            )
        if got["sha256"] != want["sha256"]:
            raise Damaged(
                ckpt_dir / name,
                f"sha256 {got['sha256'][:16]} is not the manifest's {want['sha256'][:16]}",
            )


def read_state(ckpt_dir: Path) -> CheckpointState:
    """The checkpoint's state, once its files match its manifest and its trained ids what its
    state names; Damaged (naming the file) otherwise."""
    ckpt_dir = Path(ckpt_dir)
    _verify_files(ckpt_dir)
    raw = _raw_state(ckpt_dir)
    try:
        ids = _stored_ids(ckpt_dir.parent, raw)
        names = {f.name for f in fields(CheckpointState)} - {"trained_ids"}
        return CheckpointState(**{k: raw[k] for k in names if k in raw}, trained_ids=tuple(ids))
    except Damaged:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        log = raw.get("trained_ids_log") or raw.get("trained_ids_base") or {}
        where = ckpt_dir.parent / IDS_DIR / log["file"] if log.get("file") else ckpt_dir
        raise Damaged(where, f"unreadable trained ids: {type(e).__name__}: {e}") from e


def latest_checkpoint(root: Path) -> tuple[Path, CheckpointState] | None:
    """The newest complete checkpoint under `root`, or None; Damaged if it is damaged."""
    dirs = _step_dirs(Path(root))
    if not dirs:
        return None
    return dirs[-1], read_state(dirs[-1])


def resume_point(root: Path, log=None) -> tuple[Path, CheckpointState] | None:
    """The newest checkpoint under `root` that reads back as written, or None; each newer one
    that does not is set aside (`set_aside`)."""
    for ckpt_dir in reversed(_step_dirs(Path(root))):
        try:
            return ckpt_dir, read_state(ckpt_dir)
        except Damaged as e:
            set_aside(ckpt_dir, e, log or get_logger())
    return None


def set_aside(ckpt_dir: Path, damage: Damaged, log) -> Path:
    """Move a damaged checkpoint to `<root>/damaged/<name>-<utc time>` (kept for a post-mortem,
    never read again), with a copy of the trained-ids log it names; a log line names the damaged
    file and the reason. Returns where it went."""
    root = ckpt_dir.parent
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = root / DAMAGED_DIR / f"{ckpt_dir.name}-{stamp}-{uuid.uuid4().hex[:4]}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(ckpt_dir, dest)
    _fsync_dir(root)
    try:  # the log it names is deleted once no kept checkpoint names it: keep a copy
        named = _raw_state(dest).get("trained_ids_log") or {}
        if named.get("file"):
            shutil.copy2(root / IDS_DIR / named["file"], dest / named["file"])
    except (OSError, ValueError):
        pass  # unreadable state or no log: nothing more to keep
    _WRITTEN.at(root).states.pop(ckpt_dir.name, None)
    log.error(
        "checkpoint_set_aside",
        checkpoint=str(ckpt_dir),
        file=str(damage.file),
        reason=damage.reason,
        moved_to=str(dest),
    )
    return dest


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
    still kept, by step directory name (the next checkpoint continues the log of the one it
    prunes, and pruning reads the logs they name, without reading them back: a complete
    checkpoint is never changed), and the logs it created (the only ones it appends to). One root: a trainer
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


def _donor(root: Path, latest: list[Path], keep: int) -> dict | None:
    """The state of the checkpoint whose log the next one continues: the newest of those it
    prunes, when no checkpoint kept beside the next one names its log; else None."""
    if len(latest) < keep:
        return None
    try:
        donor = _read(root, latest[-keep])
        kept = [_read(root, d) for d in latest[len(latest) - keep + 1 :]]
    except (OSError, ValueError):
        return None  # unreadable: this checkpoint starts a log of its own
    file = (donor.get("trained_ids_log") or {}).get("file")
    if any((k.get("trained_ids_log") or {}).get("file") == file for k in kept):
        return None
    return donor


def _state(root: Path, state: CheckpointState, latest: list[Path], keep: int) -> dict:
    """`state` as its state.json holds it (the ids appended to a log first)."""
    raw = {f.name: getattr(state, f.name) for f in fields(state) if f.name != "trained_ids"}
    raw["manifest"] = MANIFEST_FILE
    ids = state.trained_ids
    if not ids:
        return {**raw, "trained_ids": []}
    donor = _donor(root, latest, keep)
    log = _append_ids(root, ids, donor) or _new_log(root, state.step, ids)
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


def _seal(top: Path) -> None:
    """fsync every file under `top` and list its size and sha256 in `top`/manifest.json (read
    back once: what the page cache holds is what was written), then fsync the manifest and each
    directory (their entries)."""
    files = {}
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                rel = os.path.relpath(os.path.join(dirpath, name), top)
                files[rel] = {"bytes": os.fstat(f.fileno()).st_size, "sha256": _sha256(f)}
                os.fsync(f.fileno())
    with open(top / MANIFEST_FILE, "wb") as f:
        f.write(json.dumps({"files": files}, indent=1, sort_keys=True).encode())
        os.fsync(f.fileno())
    for dirpath, _, _ in os.walk(top):
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
        raw = _state(root, state, latest, keep)
        (tmp / STATE_FILE).write_text(json.dumps(raw, separators=(",", ":")))
        _seal(tmp)  # on disk before the name says complete (a power cut leaves zeros)
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
