"""asyncrl.retry.jetstream_call: idempotent JetStream writes ride out transient NATS errors."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from asyncrl.retry import jetstream_call


class Flaky:
    """Fails with `errors` in turn, then returns 'stored'."""

    def __init__(self, *errors: BaseException):
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "stored"


async def test_first_attempt_succeeds_without_retry():
    write = Flaky()
    assert await jetstream_call(write) == "stored"
    assert write.calls == 1


async def test_transient_errors_are_retried_until_the_write_is_stored():
    write = Flaky(
        nats.errors.NoRespondersError(),
        nats.js.errors.NoStreamResponseError(),
        nats.errors.TimeoutError(),
        nats.js.errors.ServiceUnavailableError(),
    )
    assert await jetstream_call(write, max_delay_s=30) == "stored"
    assert write.calls == 5


async def test_other_errors_are_not_retried():
    write = Flaky(nats.js.errors.BadRequestError(), nats.errors.NoRespondersError())
    with pytest.raises(nats.js.errors.BadRequestError):
        await jetstream_call(write)
    assert write.calls == 1


async def test_gives_up_after_max_delay_with_the_last_error():
    write = Flaky(*[nats.errors.NoRespondersError() for _ in range(100)])
    with pytest.raises(nats.errors.NoRespondersError):
        await jetstream_call(write, max_delay_s=0.5)
    assert 2 <= write.calls < 100
