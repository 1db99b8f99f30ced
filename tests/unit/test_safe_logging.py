"""Logging on a full disk: a write that fails with ENOSPC is dropped and counted, never raised
into the code that logs, and a control loop whose log lines fail keeps running (issue 23,
point 5). The full disk is real: /dev/full answers every write with ENOSPC."""

from __future__ import annotations

import asyncio
import errno
import json
import os

import pytest
import structlog

from asyncrl.logging import SafeSink, configure_logging, get_logger, keep_running
from asyncrl.storage import is_storage_full, storage_error, storage_message

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


@pytest.fixture
def full_disk():
    """Logging configured onto /dev/full; structlog's defaults back afterwards."""
    with open("/dev/full", "w") as f:
        sink = configure_logging("test", json=True, stream=f)
        yield sink
    structlog.reset_defaults()


def test_log_lines_on_a_full_disk_are_dropped_and_counted(full_disk):
    log = get_logger()
    for i in range(5):
        log.info("tick", i=i)
    log.error("boom", exc_info=RuntimeError("x"))
    assert full_disk.dropped == 6
    assert "No space left on device" in full_disk.last_error


def test_first_line_after_the_disk_has_room_again_says_how_many_were_lost(tmp_path):
    """Space returns: the sink's descriptor now points at a file with room (dup2 over the
    /dev/full one), the next write first reports the lines lost, then writes its own."""
    out = tmp_path / "service.log"
    with open("/dev/full", "w") as full, open(out, "w") as room:
        sink = SafeSink(full)
        sink.write("lost 1\n")
        sink.write("lost 2\n")
        os.dup2(room.fileno(), full.fileno())
        sink.write("kept\n")
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and lines[1] == "kept"
    report = json.loads(lines[0])
    assert report["event"] == "log_lines_dropped" and report["lines"] == 2
    assert "No space left on device" in report["error"]
    assert sink.dropped == 2


async def test_a_loop_that_logs_on_a_full_disk_keeps_running(full_disk):
    """keep_running: each pass raises ENOSPC (as a write under var/ would) and logs it onto
    the full disk; the loop goes on after each, until cancelled."""
    passes = 0

    async def body():
        nonlocal passes
        passes += 1
        get_logger().warning("pass", n=passes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/var/weights/v3")

    task = asyncio.create_task(keep_running("test", body, get_logger(), retry_s=0.01))
    # Polled, not a fixed sleep: the first traceback rendered can take longer than the whole
    # of a short sleep on a loaded machine (CI once saw 1 pass in 0.3 s).
    for _ in range(3000):
        if passes >= 5 or task.done():
            break
        await asyncio.sleep(0.01)
    assert not task.done()
    assert passes >= 5
    assert full_disk.dropped >= 2 * passes - 2  # each pass: its line and the loop_error line
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_storage_full_is_found_through_the_exception_chain():
    try:
        try:
            with open("/dev/full", "w") as f:
                f.write("x")
                f.flush()
        except OSError as e:
            raise RuntimeError("publish weights") from e
    except RuntimeError as wrapped:
        err = storage_error(wrapped)
        assert err is not None and err.errno == errno.ENOSPC
        assert is_storage_full(wrapped)
        text = storage_message(wrapped, "/dev")
        assert text.startswith("storage full: No space left on device at /dev (")
        assert is_storage_full(text)  # the scheduler reads it back from a status message
    assert not is_storage_full(RuntimeError("nats: timeout"))
    assert not is_storage_full(OSError(errno.EACCES, "Permission denied"))


async def test_keep_running_ends_when_until_says_so_after_a_pass_that_raised():
    """`until` is read before each pass: a loop ends when its owner says it is done (the SGLang
    watcher once stopping or given up); a pass that raised does not end it before that."""
    passes = []

    async def body():
        passes.append(len(passes))
        if len(passes) == 1:
            raise RuntimeError("first pass fails")

    await asyncio.wait_for(
        keep_running("test", body, get_logger(), retry_s=0.01, until=lambda: len(passes) == 3), 5
    )
    assert passes == [0, 1, 2]
