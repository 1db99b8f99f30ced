"""A large run's scheduler record is stored whole: at B = 2,048 groups a step (eta 2, 4,096
rollouts in flight) it holds 81,920 awaiting tickets and 4,096 in flight, 1.3 MB of JSON, over
nats-server's default 1 MiB message limit (`nats_config` raises it: `MAX_PAYLOAD`)."""

from __future__ import annotations

from asyncrl.ticket import Ticket
from services.scheduler.records import ExperimentRecord
from services.scheduler.state import StateStore


def large_record(batch: int = 2048, eta: int = 2, in_flight: int = 4096) -> ExperimentRecord:
    """A record with as many tickets as `Dispatcher.awaiting_max` lets it hold."""
    awaiting = 8 * ((eta + 1) * batch + in_flight)
    record = ExperimentRecord(id="exp-large", name="large", spec={"trainer": {"batch_size": batch}})
    record.awaiting = [Ticket(epoch=k // 50_000, index=k % 50_000) for k in range(awaiting)]
    record.inflight = [Ticket(epoch=1, index=i, attempt=1) for i in range(in_flight)]
    return record


async def test_a_record_over_one_mib_is_stored_and_read_back(js):
    record = large_record()
    assert len(record.to_json()) > 2**20  # over nats-server's default max_payload
    store = await StateStore.open(js)
    await store.save(record)
    [loaded] = await store.load_all()
    assert loaded.awaiting == record.awaiting
    assert loaded.inflight == record.inflight
