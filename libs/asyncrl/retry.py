"""Named tenacity retry policies. Only idempotent calls retry; every RPC has a deadline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import nats.errors
import nats.js.errors
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential_jitter,
)

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _is_transient_rpc_error(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE_CODES


def idempotent_rpc(attempts: int = 5, max_delay_s: float = 30.0) -> AsyncRetrying:
    """For idempotent RPCs (get, list, heartbeat, register, score): retry transient errors."""
    return AsyncRetrying(
        retry=retry_if_exception(_is_transient_rpc_error),
        stop=stop_after_attempt(attempts) | stop_after_delay(max_delay_s),
        wait=wait_exponential_jitter(multiplier=0.1, max=2.0),
        reraise=True,
    )


def connect_policy(max_delay_s: float = 60.0) -> AsyncRetrying:
    """For connecting to a dependency that may still be starting (nats, scheduler)."""
    return AsyncRetrying(
        stop=stop_after_delay(max_delay_s),
        wait=wait_exponential_jitter(multiplier=0.2, max=2.0),
        reraise=True,
    )


TRANSIENT_NATS_ERRORS = (
    nats.errors.TimeoutError,  # no reply in time: a node or a stream leader is being replaced
    nats.errors.NoRespondersError,  # nobody serves the request yet (no stream leader)
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,  # 503: JetStream temporarily unavailable
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
)


def _is_transient_nats_error(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT_NATS_ERRORS)


def jetstream_write(max_delay_s: float = 60.0) -> AsyncRetrying:
    """For idempotent JetStream writes (a publish with a Nats-Msg-Id, an object put that
    replaces): ride out a NATS node's loss, the reconnect to another node and the election of a
    new stream leader (seconds on a cluster), instead of failing the work that wrote."""
    return AsyncRetrying(
        retry=retry_if_exception(_is_transient_nats_error),
        stop=stop_after_delay(max_delay_s),
        wait=wait_exponential_jitter(multiplier=0.2, max=2.0),
        reraise=True,
    )


T = TypeVar("T")


async def jetstream_call(fn: Callable[[], Awaitable[T]], max_delay_s: float = 60.0) -> T:
    """`await fn()` (an idempotent JetStream write), retried as `jetstream_write` retries. The
    first attempt runs outside tenacity: its bookkeeping (~20 µs) is paid only after a failure,
    not on every group published."""
    try:
        return await fn()
    except TRANSIENT_NATS_ERRORS:
        pass
    async for attempt in jetstream_write(max_delay_s):
        with attempt:
            return await fn()
    raise AssertionError("unreachable: jetstream_write reraises its last error")
