"""Chaos scenarios of damaged checkpoints and deep rewinds (issue 23 points 6 and 9).

corrupt-checkpoint: the trainer is frozen (SIGSTOP: no checkpoint completes meanwhile), 4 KiB
of garbage go into the middle of its newest checkpoint's model.pt, then it is killed (-9). The
restarted trainer must set that checkpoint aside (its log names the file) and resume from the
older one: a rewind of up to 2 x checkpoint_every versions.

deep-rewind: with checkpoint_every 16, the trainer is killed 5 or more versions past its last
checkpoint, deeper than the weight store keeps (keep_versions(eta 2) = 5): the resumed trainer
writes the checkpoint's version again and trains on from it; the fleet must load those and no
rollout may be fenced for a version the store deleted.
"""

from __future__ import annotations

import json
import os
import random
import signal
from typing import TYPE_CHECKING

from tests.chaos.scenarios import Scenario

if TYPE_CHECKING:
    from tests.chaos.run import Run

GARBAGE = 4096
DEEP_EVERY = 16
"""deep-rewind's checkpoint interval. 8 left too few versions between the kill and the next
checkpoint: at 0.05-0.1 s a step the trainer passed v16 and checkpointed there between the
poll that saw v13-15 and the kill (`make chaos --repeat 2`, 2026-11-27: rewound 1)."""
DEEP_MIN = 5
"""deep-rewind: the fewest versions the kill must throw away."""


def _events(run: Run, service: str, *events: str) -> list[dict]:
    """The lines of these events in the service's log (JSON lines under <var>/log), in order."""
    out = []
    for path in sorted((run.cfg.var / "log").glob(f"{service}-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and any(f'"{e}"' in line for e in events):
                entry = json.loads(line)
                if entry.get("event") in events:
                    out.append(entry)
    return out


def _rewound_by(run: Run, fault: dict) -> int:
    """Versions between the fault and the lowest version the run went back to."""
    seen = [v for t, v in run.timeline if t >= fault["at_s"]]
    return fault["at_version"] - min(seen, default=fault["at_version"])


def _rewound_in_log(run: Run) -> int:
    """Versions the restarted trainer threw away, from its own log: its last `train_step`
    before it resumed less the version it resumed from. The polled timeline misses steps
    shorter than a poll (0.06 s a step on an idle machine, 2026-11-27: the kill landed after
    v16, the first poll after the restart read v11, and the rewind from 16 to 8 read 4)."""
    last, rewound = 0, 0
    for event in _events(run, "trainer", "train_step", "experiment_started"):
        if event["event"] == "train_step":
            last = event["version"]
        elif event.get("resumed"):
            rewound = max(rewound, last - event["version"])
    return rewound


async def corrupt_checkpoint(run: Run, rng: random.Random) -> None:
    version = 9 + rng.randrange(4)  # two checkpoints (every 4) behind it: one to fall back on
    if not await run.reach_in_time(version):
        return
    pid = await run.pid("trainer")
    os.kill(pid, signal.SIGSTOP)
    root = run.cfg.var / "checkpoints" / run.experiment_id
    newest = sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())[-1]
    model = (newest / "backend" / "model.pt").absolute()  # as the trainer logs it
    with open(model, "r+b") as f:
        f.seek(os.path.getsize(model) // 2)
        f.write(rng.randbytes(GARBAGE))
    os.kill(pid, signal.SIGKILL)
    fault = run.mark(f"4 KiB garbage into {newest.name}/backend/model.pt, kill -9 trainer")
    if not await run.recovered(fault, "trainer", pid):
        return
    aside = _events(run, "trainer", "checkpoint_set_aside")
    fault["set_aside"] = [{k: e[k] for k in ("file", "reason")} for e in aside]
    fault["rewound_versions"] = _rewound_by(run, fault)
    if [e["file"] for e in aside] != [str(model)]:
        run.errors.append(f"expected {model} set aside once, the trainer logged {aside}")


async def deep_rewind(run: Run, rng: random.Random) -> None:
    version = DEEP_EVERY + DEEP_MIN + rng.randrange(2)  # 21 or 22: the last checkpoint is 16
    if not await run.reach_in_time(version):
        return
    pid = await run.pid("trainer")
    os.kill(pid, signal.SIGKILL)
    fault = run.mark(f"kill -9 trainer (pid {pid}), checkpoint_every {DEEP_EVERY}")
    if not await run.recovered(fault, "trainer", pid):
        return
    fault["rewound_versions"] = _rewound_in_log(run)
    fault["rewound_seen"] = _rewound_by(run, fault)
    fenced = [e["reason"] for e in _events(run, "scheduler", "rollout_fenced")]
    fault["fenced"] = fenced
    if fault["rewound_versions"] < DEEP_MIN:
        run.errors.append(f"rewound {fault['rewound_versions']} versions, not >= {DEEP_MIN}")
    if fenced:
        run.errors.append(f"rollouts fenced after the rewind: {fenced}")


def scenarios() -> list[Scenario]:
    return [
        Scenario(
            "corrupt-checkpoint",
            "4 KiB garbage in newest model.pt, kill -9 trainer",
            corrupt_checkpoint,
        ),
        Scenario(
            "deep-rewind",
            f"kill -9 trainer >= {DEEP_MIN} versions past a checkpoint",
            deep_rewind,
            sets=(f"trainer.checkpoint_every={DEEP_EVERY}",),
        ),
    ]
