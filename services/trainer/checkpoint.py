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
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "state.json"
BACKEND_DIR = "backend"
PREFIX = "step_"


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


def read_state(ckpt_dir: Path) -> CheckpointState:
    raw = json.loads((Path(ckpt_dir) / STATE_FILE).read_text())
    raw["trained_ids"] = tuple(raw.get("trained_ids", ()))  # absent before ids were kept
    return CheckpointState(**raw)


def latest_checkpoint(root: Path) -> tuple[Path, CheckpointState] | None:
    """The newest complete checkpoint under `root`, or None."""
    dirs = _step_dirs(Path(root))
    if not dirs:
        return None
    return dirs[-1], read_state(dirs[-1])


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
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        if final.exists():  # a leftover without state.json: incomplete, never readable
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in _step_dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final
