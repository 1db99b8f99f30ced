"""The weight update off the trainer's critical path, on the demo workload at eta = 2.

The demo (examples/arith: the warm-started tiny model learning three-digit addition, megatron
backend, 6-token answers, trainer-bound) runs on all services as `make up` starts them (the
bench's cluster: a temporary var dir, TLS and tokens, one replica each, one torch thread each).
From the experiment's own StepMetrics, every step but the first (whose wait is start-up):

- `trainer_busy` = time in `train_step` / the trainer's wall time, from its first step's start
  to its last step's end (= the steps + the waits for groups + the stalls). Peer: 1.0, a trainer
  that never waits.
- `weight_update_stall` = critical-path time spent on the weight update per step (`stall_s`:
  the previous step's end to this one's start, less the time collecting the batch) / the
  `train_step` time. Peer: the same ratio were the update on the critical path as a whole
  (serialise + write + CommitWeights + the fleet's UpdateWeights, measured in the same run), so
  the ratio is the share of the update's time the trainer still waits for. Goal: <= 0.05.

Settings carry the mean of every phase, the fleet's lag and the run's max staleness (<= eta).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

import yaml

from bench.report import Context, Result
from bench.system import LocalCluster, run_to_end

NAME = "weight_sync"
ROOT = Path(__file__).resolve().parents[1]
ETA = 2
PHASES = (
    "wait_s",
    "serialize_s",
    "write_s",
    "commit_s",
    "checkpoint_s",
    "stall_s",
    "fleet_update_s",
    "fleet_lag_s",
    "rollout_read_s",
    "rollout_pause_s",
    "rollout_load_s",
    "rollout_resume_s",
    "scheduler_s",
)


def build_demo(root: Path, quick: bool) -> Path:
    """The demo's model and data under `root`, built once (the warm start takes a while;
    --quick stops it at once: the smoke run needs the pipeline, not the task)."""
    model = root / "model"
    if not (model / "config.json").is_file():
        target = ["--target", "0"] if quick else []
        subprocess.run(
            [sys.executable, "-m", "examples.arith.build", "--out", str(model), *target],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    return root


def demo_spec(root: Path, steps: int, quick: bool) -> dict:
    """examples/arith/experiment.yaml on the built model, at eta = 2, for `steps` steps (quick:
    every group kept and a small eval, the untrained model rarely gets a reward)."""
    spec = yaml.safe_load((ROOT / "examples/arith/experiment.yaml").read_text())
    spec["name"] = f"weight-sync-eta{ETA}"
    spec["model"]["path"] = str(root / "model")
    spec["dataset"]["path"] = str(root / "train.jsonl")
    spec["eval"]["dataset_path"] = str(root / "eval.jsonl")
    spec["rollout"]["max_head_offpolicyness"] = ETA
    spec["trainer"]["total_steps"] = steps
    if quick:
        spec["rollout"]["filter"] = "none"
        spec["eval"]["max_prompts"] = 8
    return spec


def figures(history: list) -> dict:
    """trainer_busy, weight_update_stall and its serial peer, from the steps' metrics."""
    rest = history[1:]
    train = sum(m.step_time_s for m in history)
    wall = train + sum(m.wait_s + m.stall_s for m in rest)
    rest_train = sum(m.step_time_s for m in rest)
    serial = sum(m.serialize_s + m.write_s + m.commit_s + m.fleet_update_s for m in rest)
    return {
        "trainer_busy": train / wall,
        "weight_update_stall": sum(m.stall_s for m in rest) / rest_train,
        "serial_stall": serial / rest_train,
        "trainer_wall_s": wall,
        "train_s": train,
        "means": {k: round(mean(getattr(m, k) for m in rest), 5) for k in PHASES},
        "step_time_s": round(rest_train / len(rest), 5),
        "staleness_max": max(m.staleness_max for m in history),
    }


def run(ctx: Context) -> list[Result]:
    steps = ctx.size(60, 6)
    root = build_demo(ctx.work_dir / "arith", ctx.quick)
    spec = demo_spec(root, steps, ctx.quick)
    with LocalCluster(ctx.work_dir / "weight_sync_var") as cluster:
        exp = asyncio.run(
            run_to_end(cluster.scheduler, spec, timeout_s=ctx.size(900, 300), poll_s=1.0)
        )
    f = figures(list(exp.history))
    settings = {
        "eta": ETA,
        "steps": len(exp.history),
        "workload": "examples/arith (megatron backend, torch engine, B=16, n=16)",
        "experiment_wall_s": round((exp.updated_unix_ms - exp.created_unix_ms) / 1000, 2),
        "trainer_wall_s": round(f["trainer_wall_s"], 2),
        "train_s": round(f["train_s"], 2),
        "step_time_s": f["step_time_s"],
        "staleness_max": f["staleness_max"],
        "mean_phase_s": f["means"],
    }
    return [
        Result(NAME, "trainer_busy", f["trainer_busy"], "fraction",
               "a trainer that never waits", 1.0, settings),
        Result(NAME, "weight_update_stall", f["weight_update_stall"], "of train_step",
               "the whole update on the critical path (same run)", f["serial_stall"],
               {**settings, "goal": "<= 0.05"}),
    ]  # fmt: skip


if __name__ == "__main__":  # python -m bench.weight_sync [--quick]: this benchmark alone
    import tempfile

    with tempfile.TemporaryDirectory(prefix="asyncrl-weight-sync-") as tmp:
        results = run(Context(work_dir=Path(tmp), quick="--quick" in sys.argv))
    print(json.dumps([r.to_json() for r in results], indent=1))
