"""The ledger on a real nats-server: events appended by two writers are read back in order,
summarized, and printed by `asyncrl ledger`."""

from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from asyncrl.cli import app
from asyncrl.ledger import (
    LEDGER_STREAM,
    Ledger,
    ensure_ledger,
    fetch_report,
    ledger_subject,
    read_events,
)
from asyncrl.natsutil import connect, read_subject


async def _write_run(js) -> None:
    """Three prompts: two trained at step 1, one left over; and another experiment's event."""
    await ensure_ledger(js)
    await ensure_ledger(js)  # idempotent
    scheduler, trainer = Ledger(js, "exp-a"), Ledger(js, "exp-a")
    await Ledger(js, "exp-b").record("dispatched", group="b0", prompt="x", epoch=0, index=0)
    for i in range(3):
        await scheduler.record("dispatched", group=f"g{i}", prompt=f"p{i}", epoch=0, index=i)
        await scheduler.record("settled", group=f"g{i}", status="accepted", reason="")
    await trainer.record("trained", step=1, version=1, groups=["g0", "g1"], run="r1")
    await scheduler.record("left_over", groups=["g2"])


async def test_ledger_round_trip_summarized(nats_server, js):
    await _write_run(js)
    events = await read_events(js, "exp-a")
    assert [e["event"] for e in events][:2] == ["dispatched", "settled"] and len(events) == 8
    report = await fetch_report("exp-a", nats_server.url)
    assert report.totals["trained"] == 2 and report.totals["left_over"] == 1
    assert report.totals["lost"] == 0 and report.trained_groups == 2
    assert (await fetch_report("exp-none", nats_server.url)).totals["trained"] == 0


def test_cli_ledger_json_prints_totals_and_rows(nats_server):
    async def write():
        nc = await connect(nats_server.url, identity="scheduler")
        await _write_run(nc.jetstream())
        await nc.close()

    asyncio.run(write())
    result = CliRunner().invoke(app, ["ledger", "exp-a", "--json", "--nats", nats_server.url])
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    assert got["totals"]["trained"] == 2 and got["prompts"][2]["fate"] == "left_over"


async def test_emitted_events_are_stored_in_order_after_flush(js):
    await ensure_ledger(js)
    ledger = Ledger(js, "exp-c")
    for i in range(50):
        ledger.emit("dispatched", group=f"g{i}", prompt="p", epoch=0, index=i)
    await ledger.record("left_over", groups=["g0"])  # after every earlier emit
    events = await read_events(js, "exp-c")
    assert [e.get("index") for e in events[:50]] == list(range(50))
    assert events[-1]["event"] == "left_over" and len(events) == 51


async def test_events_emitted_together_are_stored_as_one_message(js):
    await ensure_ledger(js)
    ledger = Ledger(js, "exp-d")
    for i in range(10):
        ledger.emit("dispatched", group=f"g{i}", prompt="p", epoch=0, index=i)
        await asyncio.sleep(0)  # separate passes of the loop, within the linger
    await ledger.flush()
    messages = await read_subject(js, LEDGER_STREAM, ledger_subject("exp-d"))
    assert len(messages) == 1 and len(json.loads(messages[0])) == 10
