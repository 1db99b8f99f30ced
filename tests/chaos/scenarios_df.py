"""The chaos scenario of a full disk (issue 23, point 5; the graceful stops of point 10 are in
`scenarios_stop`).

- `disk-full`: the run's var dir (nats's store, weights, checkpoints, logs, secrets) is a
  DISK_MB tmpfs in a mount namespace of the run's own (made in `before_up`, unmounted in
  `after_down`); at a drawn version it is filled to the last byte, DISK_FULL_S later freed.
  The fault records the experiment messages seen meanwhile (`pause_reasons`: the run must say
  storage is full), how long after the free the run made new progress (`after_free_s`) and
  whether the supervisor restarted nats-server (`nats_restarts`).
"""

from __future__ import annotations

import asyncio
import ctypes
import random
import shutil
import statistics
import subprocess
from typing import TYPE_CHECKING

from asyncrl.client import AsyncrlClient

if TYPE_CHECKING:
    from tests.chaos.run import Run
    from tests.chaos.scenarios import Scenario

DISK_MB = 100
DISK_FULL_S = 60.0
CLONE_NEWNS = 0x00020000


def mount_tmpfs(run: Run) -> None:
    """A mount namespace of this runner's own (inherited by `make up` and everything it
    starts), private, with a DISK_MB tmpfs on the run's var dir."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    var = run.cfg.var
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(var)], check=True
    )


def unmount_tmpfs(run: Run) -> None:
    """The logs kept beside the var dir (<var>-log), then the tmpfs unmounted, so result.json
    lands on the real disk."""
    var = run.cfg.var
    keep = var.parent / f"{var.name}-log"
    shutil.rmtree(keep, ignore_errors=True)
    if (var / "log").is_dir():
        shutil.copytree(var / "log", keep)
    subprocess.run(["umount", "-l", str(var)], check=False)


def fill(path) -> int:
    """Write zeros to `path` until the file system is full; the bytes written."""
    written = 0
    with open(path, "wb", buffering=0) as f:
        for size in (2**20, 4096, 1):
            chunk = bytes(size)
            while True:
                try:
                    written += f.write(chunk)
                except OSError:
                    break
    return written


def step_s(run: Run) -> float | None:
    """The median time between two versions so far."""
    times = [t for t, _ in run.timeline]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return round(statistics.median(gaps), 2) if gaps else None


def nats_restarts(run: Run) -> int:
    try:
        return sum(p["restarts"] for p in run.processes() if p["service"] == "nats")
    except (OSError, ValueError):
        return -1


async def messages_until(run: Run, seconds: float, seen: list[str]) -> None:
    """Poll the experiment's message for `seconds`, keeping each new one."""
    async with AsyncrlClient(run.scheduler, timeout_s=2.0) as client:
        end = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < end:
            try:
                message = (await client.get(run.experiment_id)).message
            except Exception:  # noqa: BLE001 - the scheduler or nats away: no poll this time
                message = None
            if message and message not in seen:
                seen.append(message)
            await asyncio.sleep(1.0)


async def disk_full(run: Run, rng: random.Random) -> None:
    from tests.chaos.scenarios import targets

    (version,) = targets(rng, 1, run.cfg.total_steps)
    if not await run.reach_in_time(version):
        return
    before = nats_restarts(run)
    filler = run.cfg.var / "fill"
    written = await asyncio.to_thread(fill, filler)
    fault = run.mark(f"var dir ({DISK_MB} MiB tmpfs) full for {DISK_FULL_S:.0f}s")
    fault |= {"filled_mib": round(written / 2**20, 1), "step_s": step_s(run)}
    seen: list[str] = []
    await messages_until(run, DISK_FULL_S, seen)
    filler.unlink()
    freed = run.since()
    fault |= {"back_s": round(freed - fault["at_s"], 2), "pause_reasons": seen}
    if await run.advance():
        fault["after_free_s"] = round(run.since() - freed, 2)
    fault["nats_restarts"] = nats_restarts(run) - before
    if not any("storage full" in m for m in seen):
        run.errors.append(f"no 'storage full' message while the disk was full: {seen}")


def scenarios(scenario: type[Scenario]) -> list[Scenario]:
    full = scenario(
        "disk-full",
        f"var on a {DISK_MB} MiB tmpfs, full for {DISK_FULL_S:.0f}s",
        disk_full,
        before_up=mount_tmpfs,
        after_down=unmount_tmpfs,
    )
    return [full]
