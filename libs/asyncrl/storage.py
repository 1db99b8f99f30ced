"""A full disk told apart from other failures, so it is reported as what it is.

A write that fails with ENOSPC or EDQUOT (an `OSError` anywhere in an exception's chain, or
a message that names it: a gRPC status's details, a trainer's failure message) is a storage
fault: the run pauses with the reason (`storage_message`) and resumes when space returns; it
never counts as the trainer failing.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
STORAGE_FULL = "storage full"
"""Every storage message starts so (what `is_storage_full` also finds in a text)."""
_TEXTS = ("no space left on device", "disk quota exceeded", STORAGE_FULL)


def _chain(exc: BaseException):
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def storage_error(exc: BaseException) -> OSError | None:
    """The OSError of a full disk or quota in `exc`'s chain, or None."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
    return None


def is_storage_full(error: BaseException | str) -> bool:
    """Whether `error` (an exception, or a message) is a full disk or quota."""
    if isinstance(error, BaseException):
        if storage_error(error) is not None:
            return True
        error = str(error)
    text = error.lower()
    return any(t in text for t in _TEXTS)


def storage_message(exc: BaseException, where: str | Path = "") -> str:
    """`storage full: <why> at <path> (<free> MiB free)`: the file the write failed on (else
    `where`) and the space its file system has now."""
    err = storage_error(exc)
    why = (err.strerror if err is not None else None) or str(exc)
    path = (err.filename if err is not None else None) or where
    text = f"{STORAGE_FULL}: {why}"
    if path:
        text += f" at {path}"
        free = free_bytes(path)
        if free is not None:
            text += f" ({free / 2**20:.1f} MiB free)"
    return text


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system of `path` (its nearest existing parent); None if none."""
    p = Path(path)
    for candidate in (p, *p.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None
