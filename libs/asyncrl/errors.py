"""The domain exceptions every service raises, and the one mapping from them to gRPC status
codes (applied by `asyncrl.runtime.ErrorInterceptor`, once per process).

Only `BadRequest` (and its kin `SpecError`) blames the caller with INVALID_ARGUMENT, and
`PermissionDenied` refuses an authenticated caller the entity it asked about. Any other
exception is a bug or an outage on our side: INTERNAL, with an id that the service's log
carries next to the traceback.
"""

from __future__ import annotations

import grpc


class BadRequest(ValueError):
    """A request field is invalid. `field` is its dotted path, `reason` says why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class SpecError(BadRequest):
    """An experiment spec field is invalid (`field` is e.g. ``trainer.lr``)."""


class NotFound(LookupError):
    """A named entity (experiment, worker) does not exist."""


class Conflict(RuntimeError):
    """The request contradicts the current state (e.g. wrong experiment bound)."""


class PermissionDenied(Exception):
    """The caller is authenticated and its role may make this call, but not for this entity
    (e.g. a trainer committing weights for an experiment it is not bound to)."""


class Unavailable(Exception):
    """Not now, maybe soon: the caller retries (UNAVAILABLE is what `asyncrl.retry` retries)."""


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


MAX_DETAILS_BYTES = 2000
"""A status message is cut to this many UTF-8 bytes: it travels as percent-encoded trailing
metadata (up to 3 bytes a byte), and gRPC refuses metadata over 8 KiB with RESOURCE_EXHAUSTED
in place of the status itself (an error echoing a 1 MiB id once did that)."""


def status_message(text: str) -> str:
    """`text` as a status message: whole when short, else its start and its length."""
    data = text.encode()
    if len(data) <= MAX_DETAILS_BYTES:
        return text
    head = data[:MAX_DETAILS_BYTES].decode(errors="ignore")
    return f"{head}... ({len(text)} characters)"


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code a domain exception maps to; INTERNAL for anything else."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL
