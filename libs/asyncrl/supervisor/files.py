"""The supervisor's files under the var directory (see `asyncrl.supervisor.daemon`): where
each one lives, atomic JSON writes, and the running daemon's pid."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from asyncrl.proc import pid_alive


@dataclass(frozen=True)
class Paths:
    var: Path

    @property
    def run(self) -> Path:
        return self.var / "run"

    @property
    def logs(self) -> Path:
        return self.var / "log"

    @property
    def pidfile(self) -> Path:
        return self.run / "supervisor.pid"

    @property
    def state(self) -> Path:
        return self.run / "state.json"

    @property
    def replicas(self) -> Path:
        return self.run / "replicas.json"

    @property
    def handover(self) -> Path:
        return self.run / "handover"

    @property
    def supervisor_log(self) -> Path:
        return self.logs / "supervisor.log"

    def log(self, service: str, index: int) -> Path:
        return self.logs / f"{service}-{index}.log"


def write_json(path: Path, data) -> None:
    """Atomic write: readers never see a half-written file."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def supervisor_pid(paths: Paths) -> int | None:
    """The running daemon's pid, or None."""
    try:
        pid = int(paths.pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None
