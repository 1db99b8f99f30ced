"""The supervisor's reading of nats-server's log (issue 23, point 5): `no space left on
device` lines written while the store has room mean the broker kept a write error and must
be restarted; lines written with the disk full, or before the watch began, do not count."""

from __future__ import annotations

from asyncrl.supervisor.broker import NatsLogWatch

LINE = (
    "[7] 2026/11/26 17:45:00.5 [ERR] JetStream failed to store a msg on stream '$G > "
    "ASYNCRL_LEDGER': write var/nats/jetstream/$G/streams/ASYNCRL_LEDGER/msgs/1.blk: "
    "no space left on device\n"
)
OK = "[7] 2026/11/26 17:45:01.0 [INF] Server is ready\n"


def test_two_storage_errors_logged_with_room_are_a_reason_to_restart(tmp_path):
    log = tmp_path / "nats-0.log"
    log.write_text(LINE * 5)  # before the watch: not counted
    watch = NatsLogWatch(log, tmp_path, limit=2, min_free_bytes=1)
    assert watch.stuck() == ""
    with open(log, "a") as f:
        f.write(OK + LINE)
    assert watch.stuck() == ""  # one
    with open(log, "a") as f:
        f.write(LINE)
    why = watch.stuck()
    assert why.startswith(f"2 write errors logged with room on {tmp_path}: ")
    assert why.endswith("no space left on device")
    watch.reset()  # restarted: counted afresh, from the end of the log
    assert watch.stuck() == ""


def test_storage_errors_logged_with_the_disk_full_do_not_count(tmp_path):
    log = tmp_path / "nats-0.log"
    log.write_text("")
    watch = NatsLogWatch(log, tmp_path, limit=2, min_free_bytes=2**62)  # "full"
    with open(log, "a") as f:
        f.write(LINE * 3)
    assert watch.stuck() == ""
