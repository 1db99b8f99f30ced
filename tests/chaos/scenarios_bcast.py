"""Chaos scenarios of `trainer.weight_sync: broadcast` (services/trainer/broadcast.py): a kill -9
while a version streams from the trainer to the rollouts, over gloo (ASYNCRL_BROADCAST_SHM=0,
how a version reaches rollouts on other hosts) and through /dev/shm (`-shm`: the same-host
default, `asyncrl.shm`).

The arith model (0.5 MB) streams in well under a millisecond: no kill lands in that. These runs
train a random-initialised model of the same tokenizer, SHAPE (60 MiB of fp32, in 1 MiB
buckets), rewarded by `coin` (a random model never answers right; the coin gives every group
rewards that differ, so every step changes the weights and each version's bytes differ from the
last). The trigger: the runner reaches the trainer's group store (`trainer.nccl_master`) as a
rollout does and waits for the plan of the next version, which the trainer writes once every
rollout said hello, just before the buckets go out; the kill follows KILL_AFTER_S later. A kill
is `mid_send` when the trainer did not finish that version's stream: (a) it logged
`broadcast_failed` for it, not `broadcast_sent`; (b) the killed trainer logged neither; and
`in_stream` when a living rollout's receive broke on the wire (a gloo error), not before its
first bucket (the group's store).

- `broadcast-rollout`: two rollouts; KILLS times kill -9 one of them (replica 0, 1, 0)
  mid-stream. The other must serve the version in flight (`weights_updated`: streamed, or read
  from the weight store after `broadcast_not_taken`) and not be fenced; the killed one must be
  fenced, and its replacement load the experiment from the store (`experiment_loaded`) and
  take a later version.
- `broadcast-trainer`: KILLS times kill -9 the trainer mid-stream. No rollout may take the
  version by stream unless the trainer finished sending it; the restarted trainer resumes from
  its checkpoint (`experiment_started`, resumed) and the run completes.

- `broadcast-shm-rollout`: the same through /dev/shm, killed at the plan itself (a rollout
  copies 60 MiB out in ~10 ms). The kill lands mid-copy when the trainer logged
  `shm_copy_late` for the version (the victim never said `done`); the survivor's copy does not
  depend on the victim's, so it must take the version by stream.
- `broadcast-shm-trainer`: the trainer killed at the plan, mid-hand-over when it logged neither
  `broadcast_sent` nor `broadcast_failed`. A rollout may take the version whole (sealed before
  the plan named the files, and checked) or fall back to the store; the restarted trainer
  resumes and removes the killed one's files from /dev/shm.

All, once the run ended: no `weights_fingerprint_mismatch` at the scheduler, and every sample
the ledger counts as trained came from weights whose fingerprint the trainer committed for
that version (`version_committed`; a rewound lineage's versions were committed too); and, as
every run, 0 lost and 0 trained twice. A run none of whose kills landed mid-send fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.shm import ROOT as SHM_ROOT
from asyncrl.shm import owned_by as shm_owned_by
from tests.chaos.watch import TERMINAL

if TYPE_CHECKING:
    from tests.chaos.run import Run
    from tests.chaos.scenarios import Scenario

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "var" / "chaos" / "task" / "model-broadcast"
SHAPE = {
    "hidden_size": 512,
    "num_layers": 4,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 2048,
}
"""15.8 M parameters: 60 MiB (63,152,128 bytes) a version."""
MASTER = "127.0.0.1:29517"
"""The trainer's group store, on the run's own loopback."""
STEPS = 45
RESERVE = 20
"""Versions left after the last kill's drawn version: a rollout's replacement took 10-14 s to
serve again at ~2.5 s a step (the suite's 30 steps and its kill points left it 5 versions)."""
PLAN_TIMEOUT_S = 120.0
KILL_AFTER_S = 0.05
"""From the plan to the kill over gloo: the receivers have read the plan and the first buckets
are on the wire (a version's send took 0.13-0.40 s here; killed at the plan itself, the trainer
died before the rollouts had read it). Through /dev/shm the kill is at the plan itself."""
GLOO = {"ASYNCRL_BROADCAST_SHM": "0"}
TRIES = 5
"""Versions tried for one kill whose plan was written before the runner watched for it."""
SERVED_TIMEOUT_S = 240.0
LEDGER_TRIES = 3
STREAM_END_S = 60.0
WINDOW_S = 5.0
"""A version's stream and its fallback are read in the logs from this long before the kill
(a trainer that was killed before took more than that to come back: an older lineage's
version of the same number is older)."""
SETS = (
    f"model.path={MODEL_DIR}",
    "trainer.weight_sync=broadcast",
    f"trainer.nccl_master={MASTER}",
    "trainer.broadcast_bucket_mb=1",
    "reward.function=plugin:tests.fixtures_plugins.rewards:coin",
)


def build_model(run: Run) -> None:
    """SHAPE at MODEL_DIR, once (built aside and renamed: runs side by side race for it)."""
    if (MODEL_DIR / "config.json").exists():
        return
    from asyncrl.tiny import build_tiny_model

    tmp = MODEL_DIR.with_name(f".{MODEL_DIR.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_model(tmp, **SHAPE)
    try:
        tmp.rename(MODEL_DIR)
    except OSError:  # another run built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)


# ---- pure: what the logs and the ledger say ----------------------------------------------


def at(entry: dict) -> float:
    """A log line's time, unix seconds."""
    return datetime.fromisoformat(entry["timestamp"]).timestamp()


def stream_end(
    trainer: list[dict], version: int, after: float = 0.0, before: float = float("inf")
) -> str:
    """How the trainer's stream of `version` ended in its log lines from `after` to `before`
    (unix s): `broadcast_sent`, `broadcast_failed`, or "" (not at all: killed, or never
    started)."""
    for e in trainer:
        if e.get("version") == version and after <= at(e) < before:
            if e["event"] in ("broadcast_sent", "broadcast_failed"):
                return e["event"]
    return ""


def committed(scheduler: list[dict]) -> dict[int, set[str]]:
    """Version -> every fingerprint committed for it (`version_committed`, all lineages)."""
    out: dict[int, set[str]] = {}
    for e in scheduler:
        if e["event"] == "version_committed":
            out.setdefault(e["version"], set()).add(e.get("fingerprint", ""))
    return out


def uncommitted_samples(ledger: dict, fingerprints: dict[int, set[str]]) -> list[str]:
    """The trained samples whose weights for some version (past the base, v0) have a
    fingerprint nobody committed for it (or none: unverified), as `e<epoch> p<i> s<k> v<v>`."""
    bad = []
    for p in ledger.get("prompts", []):
        if p.get("fate") not in ("trained", "trained_twice"):
            continue
        for k, weights in enumerate(p.get("samples", [])):
            for v, fp in weights.items():
                if int(v) and (not fp or fp not in fingerprints.get(int(v), set())):
                    bad.append(f"e{p['epoch']} p{p['index']} s{k} v{v} {fp or 'unverified'}")
    return bad


def in_stream(how: dict[str, str]) -> bool:
    """Whether a rollout's stream broke with bytes on the wire (a gloo error), not before it
    (the group's store)."""
    return "/gloo/" in how.get("not_taken", "")


def took(rollout: list[dict], version: int, since: float) -> dict[str, str]:
    """How a rollout took `version` from `since` on: `streamed` (weights_streamed),
    `not_taken` (broadcast_not_taken's reason), `updated` (weights_updated: it serves it)."""
    out = {}
    names = {"weights_streamed": "streamed", "broadcast_not_taken": "not_taken"}
    names["weights_updated"] = "updated"
    for e in rollout:
        if e.get("version") == version and e["event"] in names and at(e) >= since:
            out.setdefault(names[e["event"]], e.get("reason", ""))
    return out


# ---- the runner's side -------------------------------------------------------------------


EVENTS = (
    "broadcast_sent",
    "broadcast_failed",
    "broadcast_not_taken",
    "weights_streamed",
    "weights_updated",
    "experiment_loaded",
    "experiment_started",
    "worker_registered",
    "rollout_fenced",
    "version_committed",
    "weights_fingerprint_mismatch",
    "shm_copy_late",
)
"""The log events these runs read."""


def _log(run: Run, service: str, replica: int | None = None) -> list[dict]:
    """EVENTS in a service's logs (every replica's, or one's), in order."""
    name = f"{service}-{'*' if replica is None else replica}.log"
    out = []
    for path in sorted((run.cfg.var / "log").glob(name)):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and any(f'"{e}"' in line for e in EVENTS):
                entry = json.loads(line)
                if entry.get("event") in EVENTS:
                    out.append(entry)
    return out


def shm(run: Run) -> bool:
    """Whether the run's versions go through /dev/shm (else over gloo)."""
    return run.scenario.env.get("ASYNCRL_BROADCAST_SHM") != "0"


def late(trainer: list[dict], version: int, since: float) -> bool:
    """Whether the trainer waited out a rollout's copy of `version` (`shm_copy_late`)."""
    return any(
        e["event"] == "shm_copy_late" and e.get("version") == version and at(e) >= since
        for e in trainer
    )


def kill_at_plan(experiment_id: str, version: int, pid: int, after_s: float) -> float | None:
    """Block until the trainer wrote the plan of `version` (the start of its stream), then kill
    -9 `pid` `after_s` later; the unix time of the kill, or None when the plan was there already or did
    not come in time (nothing killed)."""
    from asyncrl.collective import open_store

    host, port = MASTER.rsplit(":", 1)
    store = open_store(host, int(port), False, PLAN_TIMEOUT_S)
    key = f"{experiment_id}/v{version}/plan"  # services/trainer/broadcast.py: store_key
    if store.check([key]):
        return None
    try:
        store.wait([key], timedelta(seconds=PLAN_TIMEOUT_S))
    except RuntimeError:  # the store's timeout, or the trainer gone
        return None
    time.sleep(after_s)
    os.kill(pid, signal.SIGKILL)
    return time.time()


async def kill_mid_stream(run: Run, service: str, replica: int = 0) -> tuple[dict, int] | None:
    """Kill -9 `service`'s replica as the trainer starts streaming a version; the fault and
    the version, or None when no plan came in TRIES versions."""
    version = 0
    for _ in range(TRIES):
        pid = await run.pid(service, replica)
        version = max(version + 1, run.version + 1)
        try:
            after_s = 0.0 if shm(run) else KILL_AFTER_S
            killed = await asyncio.to_thread(kill_at_plan, run.experiment_id, version, pid, after_s)
        except RuntimeError:  # the store not reachable (the trainer restarting)
            killed = None
        if killed is not None:
            name = f"{service}-{replica}" if service == "rollout" else service
            fault = run.mark(f"kill -9 {name} (pid {pid}) at the plan of v{version}")
            fault |= {"pid": pid, "version": version, "killed_at": killed}
            return fault, version
        if run.state in TERMINAL:
            break
    run.errors.append(f"no plan of a version came for a kill of {service}-{replica}")
    return None


async def restarted(run: Run, service: str, replica: int, pid: int, fault: dict) -> bool:
    deadline = time.monotonic() + SERVED_TIMEOUT_S
    while time.monotonic() < deadline:
        if await run.pid(service, replica, timeout=SERVED_TIMEOUT_S) != pid:
            fault["back_s"] = round(run.since() - fault["at_s"], 2)
            return True
        await asyncio.sleep(0.25)
    run.errors.append(f"{service}-{replica} not restarted {SERVED_TIMEOUT_S:.0f}s after the kill")
    return False


def _worker(rollout: list[dict], before: float) -> str:
    ids = [e["worker"] for e in rollout if e["event"] == "worker_registered" and at(e) < before]
    return ids[-1] if ids else ""


async def served_again(run: Run, replica: int, since: float) -> dict | None:
    """Wait for the replica's replacement to load the experiment from the store and take a
    later version; its `experiment_loaded` and first later `weights_updated`, or None."""
    deadline = time.monotonic() + SERVED_TIMEOUT_S
    while time.monotonic() < deadline and run.state not in TERMINAL:
        log = [e for e in _log(run, "rollout", replica) if at(e) >= since]
        loaded = next((e for e in log if e["event"] == "experiment_loaded"), None)
        if loaded is not None:
            later = [e for e in log if e["event"] == "weights_updated" and at(e) > at(loaded)]
            if any(e["version"] > loaded["version"] for e in later):
                return {"loaded": loaded["version"], "then": later[-1]["version"]}
        await asyncio.sleep(0.5)
    return None


async def kill_rollout_mid_stream(run: Run, rng: random.Random) -> None:
    from tests.chaos.scenarios import targets

    for i, version in enumerate(targets(rng, run.scenario.count, run.cfg.total_steps - RESERVE)):
        if not await run.reach_in_time(version):
            break
        victim, survivor = i % 2, 1 - i % 2
        hit = await kill_mid_stream(run, "rollout", victim)
        if hit is None:
            break
        fault, v = hit
        since = fault["killed_at"]
        if not await restarted(run, "rollout", victim, fault["pid"], fault):
            break
        again = await served_again(run, victim, since)
        fault["done_s"] = run.since()
        await stream_ended(run, v)
        judge_rollout_kill(run, fault, v, victim, survivor, again)
    await judge_run(run)


async def stream_ended(run: Run, version: int) -> None:
    """Wait (up to STREAM_END_S) for the trainer to log how its stream of `version` ended: a
    receiver killed while its group was connecting fails the send only at the group's timeout
    (30 s), after the replacement may have served already."""
    deadline = time.monotonic() + STREAM_END_S
    while not stream_end(_log(run, "trainer"), version) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)


def judge_rollout_kill(run: Run, fault: dict, v: int, victim: int, survivor: int, again) -> None:
    since = fault["killed_at"]
    dead = _worker(_log(run, "rollout", victim), since)
    other = _worker(_log(run, "rollout", survivor), since)
    fenced = [e for e in _log(run, "scheduler") if e["event"] == "rollout_fenced"]
    fenced = [e for e in fenced if at(e) >= since]
    trainer = _log(run, "trainer")
    end = stream_end(trainer, v)
    hit = late(trainer, v, since) if shm(run) else end == "broadcast_failed"
    fault |= {"mid_send": hit, "stream": end or "none"}
    fault["survivor"] = took(_log(run, "rollout", survivor), v, since - WINDOW_S)
    fault["in_stream"] = in_stream(fault["survivor"])
    if shm(run) and "streamed" not in fault["survivor"]:
        run.errors.append(f"rollout-{survivor} did not take v{v} through /dev/shm")
    fault["fenced"] = [f"{e['worker']}: {e['reason']}" for e in fenced]
    fault["replacement"] = again
    if "updated" not in fault["survivor"]:
        run.errors.append(f"rollout-{survivor} did not serve v{v}, the version in flight")
    if any(e["worker"] == other for e in fenced):
        run.errors.append(f"rollout-{survivor} ({other}) fenced after the kill of rollout-{victim}")
    if not any(e["worker"] == dead for e in fenced):
        run.errors.append(f"the killed rollout-{victim} ({dead}) was not fenced")
    if again is None:
        run.errors.append(f"rollout-{victim}'s replacement did not load from the store and serve")


async def kill_trainer_mid_stream(run: Run, rng: random.Random) -> None:
    from tests.chaos.scenarios import targets

    for version in targets(rng, run.scenario.count, run.cfg.total_steps - RESERVE):
        if not await run.reach_in_time(version):
            break
        hit = await kill_mid_stream(run, "trainer")
        if hit is None:
            break
        fault, v = hit
        went_on = await run.recovered(fault, "trainer", fault["pid"])
        if went_on:  # the stall's window ends at that new version itself
            fault["done_s"] = run.timeline[-1][0]
        judge_trainer_kill(run, fault, v)
        if not went_on:
            break
    await judge_run(run)


def judge_trainer_kill(run: Run, fault: dict, v: int) -> None:
    since = fault["killed_at"]
    trainer = _log(run, "trainer")
    end = stream_end(trainer, v, since - WINDOW_S, since)
    fault |= {"mid_send": not end, "stream": end or "none"}
    started = [e for e in trainer if e["event"] == "experiment_started" and at(e) >= since]
    fault["resumed_at"] = started[0]["version"] if started else None
    restart = at(started[0]) if started else float("inf")
    for replica in range(run.scenario.rollouts):
        log = [e for e in _log(run, "rollout", replica) if at(e) < restart]
        how = fault[f"rollout-{replica}"] = took(log, v, since - WINDOW_S)
        fault["in_stream"] = fault.get("in_stream", False) or in_stream(how)
        if "streamed" in how and end != "broadcast_sent" and not shm(run):
            run.errors.append(f"rollout-{replica} took v{v} by a stream the trainer never finished")
    if not started or not started[0].get("resumed"):
        run.errors.append("the restarted trainer did not resume from its checkpoint")
    elif shm(run):  # the restarted trainer swept the killed one's files
        left = list(SHM_ROOT.glob(f"{shm_owned_by(fault['pid'])}*"))
        fault["shm_files_left"] = len(left)
        if left:
            run.errors.append(f"{len(left)} /dev/shm files of the killed trainer left behind")


async def judge_run(run: Run) -> None:
    """Once the run ended: how many kills landed mid-send, no fingerprint mismatch, every
    trained sample's weights committed."""
    while run.state not in TERMINAL:
        if run.since() > run.timeout_s or any(e.startswith("hung") for e in run.errors):
            return
        await asyncio.sleep(0.5)
    hits = sum(bool(f.get("mid_send")) for f in run.faults)
    if run.faults and not hits:
        run.errors.append(f"none of the {len(run.faults)} kills landed mid-send")
    scheduler = _log(run, "scheduler")
    mismatch = [e for e in scheduler if e["event"] == "weights_fingerprint_mismatch"]
    if mismatch:
        run.errors.append(f"{len(mismatch)} weights_fingerprint_mismatch at the scheduler")
    for _ in range(LEDGER_TRIES):  # a read of 10 s, timed out once at load 5
        ledger = await asyncio.to_thread(run.cli_json, "ledger")
        if "error" not in ledger:
            break
    else:
        run.errors.append(f"the ledger could not be read: {ledger['error'].strip()}")
        return
    bad = uncommitted_samples(ledger, committed(scheduler))
    if bad:
        run.errors.append(f"{len(bad)} trained samples of uncommitted weights: {bad[:3]}")


def scenarios() -> list[Scenario]:
    from tests.chaos.scenarios import KILLS, Scenario

    out = []
    for suffix, via, env in (("", "gloo", GLOO), ("-shm", "/dev/shm", {})):
        what = f"broadcast ({via}): kill -9"
        common = {"count": KILLS, "rollouts": 2, "before_up": build_model, "sets": SETS}
        out += [
            Scenario(
                f"broadcast{suffix}-rollout",
                f"{what} 1 of 2 rollouts mid-stream x{KILLS}",
                kill_rollout_mid_stream,
                env=env,
                steps=STEPS,
                **common,
            ),
            Scenario(
                f"broadcast{suffix}-trainer",
                f"{what} trainer mid-stream x{KILLS}",
                kill_trainer_mid_stream,
                env=env,
                steps=STEPS,
                **common,
            ),
        ]
    return out
