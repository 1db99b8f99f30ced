"""`python -m bench --only shared_fleet`: four LoRA experiments on one rollout fleet at once,
against the same four one after another on the same fleet (issue 25 point 6).

One cluster under the supervisor (`make up`): two torch rollouts of `CAPACITY` group slots each
and four trainers (`make scale SERVICE=trainer N=4`). At once, the scheduler pools the four
(same base) on both rollouts and gives each a quarter of the slots (docs/lora.md, "Sharing a
fleet"): the fleet generates for one experiment while another's trainer steps. One after
another, each has the fleet (and a trainer) to itself. Reported: the aggregate trained
samples per second (every experiment's steps x B x n over the wall from the first submit to
the last end) of each way, and each experiment's own wall time (submit to end). A one-step
round of the four at once goes first, unmeasured: every trainer and rollout has loaded its
libraries and the model before either way is timed (cold, a trainer's first start took ~20 s
of a 1 s experiment on the 2-core machine).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

from asyncrl.tiny import build_tiny_model
from bench.report import Context, Result
from bench.system import LocalCluster, run_to_end

EXPERIMENTS = 4
CAPACITY = 4
"""Group slots per rollout: 2 x 4 = 8 slots, 2 per experiment when all four run."""
N_SAMPLES = 4
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def build_task(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen2 and single-digit additions: (model dir, train.jsonl)."""
    model, train = root / "model", root / "train.jsonl"
    if not model.exists():
        build_tiny_model(model, hidden_size=32, intermediate_size=64)
    rng = random.Random(0)
    rows = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(64)]
    train.write_text(
        "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in rows)
    )
    return model, train


def spec(model: Path, train: Path, name: str, steps: int, batch: int) -> dict:
    return {
        "name": name,
        "model": {"path": str(model)},
        "dataset": {"path": str(train), "epochs": 100},
        "rollout": {
            "engine": "torch",
            "n_samples": N_SAMPLES,
            "max_head_offpolicyness": 2,
            "max_concurrent_rollouts": 16,
            "filter": "none",
            "gconfig": {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True},
        },
        "reward": {"function": "exact_match"},
        "trainer": {
            "backend": "torch",
            "batch_size": batch,
            "total_steps": steps,
            "lr": 1e-2,
            "checkpoint_every": steps,
            "lora": LORA,
        },
    }


def walls(exps) -> list[float]:
    """Each experiment's own wall: its submit to its end, seconds."""
    return [(e.updated_unix_ms - e.created_unix_ms) / 1000 for e in exps]


async def at_once(scheduler: str, specs: list[dict]):
    return await asyncio.gather(*(run_to_end(scheduler, s, timeout_s=900) for s in specs))


async def one_after_another(scheduler: str, specs: list[dict]):
    return [await run_to_end(scheduler, s, timeout_s=900) for s in specs]


def run(ctx: Context) -> list[Result]:
    steps, batch = ctx.size(8, 3), ctx.size(8, 4)
    root = ctx.work_dir / "shared_fleet"
    root.mkdir(parents=True, exist_ok=True)
    model, train = build_task(root)
    samples = EXPERIMENTS * steps * batch * N_SAMPLES
    cluster = LocalCluster(root / "var")
    cluster.env["ASYNCRL_ROLLOUT_ARGS"] = f"--capacity {CAPACITY}"
    with cluster:
        for service, n in (("rollout", 2), ("trainer", EXPERIMENTS)):  # make scale
            done = cluster._sup("scale", service, str(n), "--timeout", "120", timeout=150)
            if done.returncode != 0:
                raise RuntimeError(f"scale {service} {n}: {done.stdout}{done.stderr}")
        warm = [spec(model, train, f"warm-{i}", 1, batch) for i in range(EXPERIMENTS)]
        asyncio.run(at_once(cluster.scheduler, warm))  # every trainer and rollout warm
        ways = {}
        for way, runner in (("at once", at_once), ("one after another", one_after_another)):
            specs = [spec(model, train, f"{way[:4]}-{i}", steps, batch) for i in range(EXPERIMENTS)]
            t0 = time.monotonic()
            exps = asyncio.run(runner(cluster.scheduler, specs))
            ways[way] = (time.monotonic() - t0, walls(exps))
    (wall_once, each_once), (wall_seq, each_seq) = ways["at once"], ways["one after another"]
    settings = {
        "experiments": EXPERIMENTS,
        "rollouts": 2,
        "slots": 2 * CAPACITY,
        "steps": steps,
        "batch": batch,
        "n_samples": N_SAMPLES,
        "wall_at_once_s": round(wall_once, 2),
        "wall_one_after_another_s": round(wall_seq, 2),
        "each_at_once_s": [round(w, 2) for w in each_once],
        "each_alone_s": [round(w, 2) for w in each_seq],
    }
    return [
        Result(
            name="shared_fleet",
            metric=f"trained samples/s, {EXPERIMENTS} LoRA experiments at once on one fleet",
            value=samples / wall_once,
            unit="samples/s",
            peer="the same four one after another on the same fleet",
            peer_value=samples / wall_seq,
            settings=settings,
        ),
        Result(
            name="shared_fleet",
            metric="mean wall per experiment at once (each shares the fleet)",
            value=sum(each_once) / EXPERIMENTS,
            unit="s",
            peer="mean wall per experiment alone",
            peer_value=sum(each_seq) / EXPERIMENTS,
            settings=settings,
        ),
    ]
