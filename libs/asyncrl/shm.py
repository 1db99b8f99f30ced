"""A broadcast version handed over through shared memory where the engines run on the trainer's
host (`trainer.weight_sync: broadcast`, CPU ranks; services/trainer/broadcast.py).

The trainer packs each version into bucket buffers that are files in /dev/shm (tmpfs: RAM that
any process of the host can map), reserved with posix_fallocate so that a /dev/shm too small
for them (a container's 64 MiB default) is an error at allocation, answered by ordinary buffers
and the socket, rather than a SIGBUS at the first write. It advertises a probe file and a
token in the group's store; a rollout that finds the token in that file (`sees`: not on
another host, nor in a container with a /dev/shm of its own) says so in its hello. When every
rollout of a version does, the plan names the version's files instead of a group: each rollout
maps them (`Maps`, kept between versions), copies every bucket into its staging buffer and
checksums the copy, so what it checks is what it applies. A bucket the trainer overwrote
meanwhile is a checksum mismatch, never a served version. No socket, no kernel copy.

The files are named `asyncrl-bcast-<pid namespace>-<pid>-<hex>-<n>`: a trainer killed with
SIGKILL leaves its files behind, and the next one on the host removes those of its PID
namespace whose process is gone (`sweep`; a trainer of another namespace sharing /dev/shm is
not looked at: its pid means nothing here).
ASYNCRL_BROADCAST_SHM=0 turns the hand-over off (every version then goes over the socket).
"""

from __future__ import annotations

import mmap
import os
import uuid
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.proc import pid_alive

if TYPE_CHECKING:
    import torch

ROOT = Path("/dev/shm")
PREFIX = "asyncrl-bcast-"


def _pid_namespace() -> str:
    """This process's PID namespace (its inode), "0" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid").split("[", 1)[1].rstrip("]")
    except (OSError, IndexError):
        return "0"


def owned_by(pid: int) -> str:
    """The name prefix of the files of the trainer of `pid` (in this PID namespace)."""
    return f"{PREFIX}{_pid_namespace()}-{pid}-"


def wait_s(nbytes: int) -> float:
    """How long the trainer waits for every rollout to copy a version of `nbytes` out: 2 s and
    the copy at 100 MB/s (memory moves GB/s; a rollout is slower only when it is gone or
    stopped, and the set is packed again only a step later)."""
    return 2.0 + nbytes / 100e6


def available(root: Path = ROOT) -> bool:
    """Whether this host has a shared-memory directory this process may write to."""
    return root.is_dir() and os.access(root, os.W_OK)


def _map(path: str, nbytes: int, writable: bool) -> torch.Tensor:
    """The file as a uint8 tensor over a shared mapping of its pages (populated up front)."""
    import torch

    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"{path} holds {size} bytes, the plan says {nbytes}")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(fd, nbytes, flags=flags, prot=prot)
    finally:
        os.close(fd)  # the mapping keeps the pages
    with warnings.catch_warnings():  # a read-only mapping: torch warns it is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)


class Region:
    """The trainer's shared bucket files (this process's), and the probe it advertises."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self.tag = f"{owned_by(os.getpid())}{uuid.uuid4().hex[:8]}"
        self.token = uuid.uuid4().hex
        self._paths: dict[int, str] = {}  # a buffer's data_ptr -> its file
        self._made = 0

    def alloc(self, nbytes: int) -> torch.Tensor | None:
        """A zeroed buffer of `nbytes` in a file of its own, or None when /dev/shm has no
        room for it (the caller allocates an ordinary one)."""
        self._made += 1
        path = self.root / f"{self.tag}-{self._made}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:  # ENOSPC: no room
            path.unlink(missing_ok=True)
            return None
        finally:
            os.close(fd)
        buf = _map(str(path), nbytes, writable=True)
        self._paths[buf.data_ptr()] = str(path)
        return buf

    def path(self, buf: torch.Tensor) -> str | None:
        """The file behind `buf`, or None for a buffer not in shared memory."""
        return self._paths.get(buf.data_ptr())

    def free(self, buf: torch.Tensor) -> None:
        """Remove `buf`'s file (its pages go once nobody maps them)."""
        path = self._paths.pop(buf.data_ptr(), None)
        if path is not None:
            Path(path).unlink(missing_ok=True)

    def advert(self) -> dict:
        """What a rollout needs to tell whether it shares this memory (`sees`)."""
        self._probe.write_text(self.token)
        return {"probe": str(self._probe), "token": self.token}

    @property
    def _probe(self) -> Path:
        return self.root / f"{self.tag}-probe"

    def close(self) -> None:
        for path in [*self._paths.values(), self._probe]:
            Path(path).unlink(missing_ok=True)
        self._paths.clear()


def sees(advert: dict) -> bool:
    """Whether this process reads the trainer's shared memory (`Region.advert`)."""
    try:
        return Path(advert["probe"]).read_text() == advert["token"]
    except (OSError, KeyError, TypeError):
        return False


def sweep(root: Path = ROOT) -> list[str]:
    """Remove the files of this PID namespace's trainers that are gone (their pid runs no
    process); their names."""
    gone, mine = [], f"{PREFIX}{_pid_namespace()}-"
    for path in root.glob(f"{mine}*") if root.is_dir() else []:
        pid = path.name.removeprefix(mine).split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            path.unlink(missing_ok=True)
            gone.append(path.name)
    return gone


class Maps:
    """A rollout's mappings of the trainer's bucket files, kept while its plans name them."""

    def __init__(self):
        self._maps: dict[str, torch.Tensor] = {}
        self._last: list[str] = []

    def view(self, path: str, nbytes: int) -> torch.Tensor:
        """The file as a read-only uint8 tensor (OSError: gone; ValueError: another size)."""
        buf = self._maps.get(path)
        if buf is None or buf.numel() != nbytes:
            buf = self._maps[path] = _map(path, nbytes, writable=False)
        return buf

    def keep(self, paths: list[str]) -> None:
        """Drop the mappings that neither `paths` nor the previous call's name (the trainer
        packs two sets of files in turn)."""
        wanted = {*paths, *self._last}
        self._maps = {p: b for p, b in self._maps.items() if p in wanted}
        self._last = list(paths)
