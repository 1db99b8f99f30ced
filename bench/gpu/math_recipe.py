"""Part `math`: the math recipe's GPU spec (examples/math/gpu.yaml) through all four services.

The services start under the supervisor as `make up` starts them (`bench.gpu.stack`), and the
recipe's spec is submitted with only what this machine forces changed (`overrides`): a
random-weight model of Qwen2.5-0.5B's shape with the character tokenizer (nothing can be
downloaded), the torch engine on `device` (SGLang is not installed), the recipe's committed
problems (examples/math/data/train.jsonl) as train and eval set, and sizes that fit the part's
time cap. The reward (`plugin:examples.math.reward:final_answer`), the megatron trainer and the
objective are the recipe's. A random model never answers a problem, so rewards are mostly 0:
the filter keeps every group (`rollout.filter=none`) so that steps still happen.

Judged as a run is judged: the experiment completes its steps, every sample read back carries
the reward `final_answer` gives its text, the ledger is clean (nothing lost, nothing trained
twice, nothing left open, trained groups = steps x B) and no service logged an error event.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from bench.gpu.shapes import build
from bench.gpu.stack import Supervisor, cluster_env, error_events, placement

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "math" / "gpu.yaml"
DATA = ROOT / "examples" / "math" / "data" / "train.jsonl"
SETTLE_S = 20.0
"""How long to wait for the ledger's last events (the trainer's left_over as it finishes)."""


def overrides(model: Path, sizes: dict) -> list[str]:
    """What the machine forces on the recipe's spec, as `asyncrl submit` overrides."""
    return [
        f"model.path={model}",
        "rollout.engine=torch",
        f"dataset.path={DATA}",
        f"eval.dataset_path={DATA}",
        f"eval.max_prompts={sizes['eval_prompts']}",
        f"eval.gconfig.max_new_tokens={sizes['max_new_tokens']}",
        "rollout.filter=none",
        f"rollout.n_samples={sizes['n_samples']}",
        f"rollout.gconfig.max_new_tokens={sizes['max_new_tokens']}",
        f"trainer.batch_size={sizes['batch_size']}",
        f"trainer.total_steps={sizes['total_steps']}",
    ]


def run(shape: str, work: Path, sizes: dict, device: str, cap_s: float) -> dict:
    from asyncrl.cli import load_spec_dict

    started = time.monotonic()
    model = build(shape, work / "models" / shape)
    var = (work / "var-math").resolve()
    env = cluster_env(var, device)
    changed = overrides(model, sizes)
    spec = load_spec_dict(SPEC, changed)
    result: dict = {
        "shape": shape,
        "device": device,
        "random_weights": True,
        "spec": str(SPEC.relative_to(ROOT)),
        "overrides": [o.replace(str(ROOT) + "/", "") for o in changed],
        "engine": spec["rollout"]["engine"],
        "backend": spec["trainer"]["backend"],
        "reward": spec["reward"]["function"],
        **sizes,
    }
    sup = Supervisor(var, env)
    try:
        t0 = time.monotonic()
        sup.call("start", "--timeout", str(sizes["start_timeout_s"]))
        result["start_s"] = round(time.monotonic() - t0, 1)
        result["gpus"] = placement(var)
        budget = cap_s - (time.monotonic() - started) - sizes["reserve_s"]
        result.update(asyncio.run(_experiment(env, spec, budget)))
    finally:
        sup.stop()
        result["problems"] = result.get("problems", []) + error_events(var / "log")
    return result


async def _experiment(env: dict, spec: dict, budget_s: float) -> dict:
    from asyncrl.client import AsyncrlClient, is_terminal, read_groups, state_name

    address = f"127.0.0.1:{env['ASYNCRL_SCHEDULER_PORT']}"
    nats_url = f"nats://127.0.0.1:{env['ASYNCRL_NATS_PORT']}"
    t0 = time.monotonic()
    async with AsyncrlClient(address) as client:
        exp = await client.submit(spec)
        while not is_terminal(exp) and time.monotonic() - t0 < budget_s:
            await asyncio.sleep(0.2)
            exp = await client.get(exp.id)
        cancelled = not is_terminal(exp)
        if cancelled:
            await client.cancel(exp.id)
        wall = time.monotonic() - t0
        exp = await client.get(exp.id, with_history=True)
    groups = [g async for g in read_groups(exp.id, nats_url)]
    steps = exp.progress.version
    out = {
        "experiment_state": state_name(exp.state),
        "cancelled_at_cap": cancelled,
        "steps": steps,
        "run_s": round(wall, 1),
        "s_per_step": round(wall / max(steps, 1), 2),
        "step_time_s": _median([h.step_time_s for h in exp.history]),
        "reward_mean_per_step": [round(h.reward_mean, 3) for h in exp.history],
        "evals": [
            {"version": e.version, "accuracy": e.accuracy, "n_prompts": e.n_prompts}
            for e in exp.progress.evals
        ],
        **rewards(groups),
    }
    ledger = await _settled_ledger(exp.id, nats_url)
    out["ledger"] = {"totals": ledger.totals, "steps": ledger.steps, "trained_groups": ledger.trained_groups}  # fmt: skip
    problems = ledger_problems(out["ledger"], steps, spec["trainer"]["batch_size"])
    out["ledger_clean"] = not problems
    if cancelled:
        problems.append(f"cancelled at the cap after {steps} of {spec['trainer']['total_steps']} steps")  # fmt: skip
    elif out["experiment_state"] != "COMPLETED":
        problems.append(f"experiment ended {out['experiment_state']}: {exp.message}"[:300])
    if out["reward_mismatches"]:
        problems.append(f"{out['reward_mismatches']} samples' rewards differ from final_answer")
    out["problems"] = problems
    return out


def rewards(groups) -> dict:
    """The samples read back, scored again by the recipe's reward: their mean, and how many
    carry a reward other than `final_answer` of their text (a reward that never ran)."""
    from asyncrl.types import RewardStatus
    from examples.math.reward import final_answer

    samples = [(g, s) for g in groups for s in g.samples]
    wrong = sum(
        s.reward_status is not RewardStatus.OK or s.reward != final_answer(s.text, g.answer)
        for g, s in samples
    )
    mean = sum(s.reward for _, s in samples) / len(samples) if samples else None
    return {"groups_read": len(groups), "samples": len(samples), "reward_mean": mean, "reward_mismatches": wrong}  # fmt: skip


def ledger_problems(ledger: dict, steps: int, batch_size: int) -> list[str]:
    """What makes a ledger unclean (tests/e2e's assert_ledger_clean, as findings)."""
    totals, found = ledger["totals"], []
    for fate in ("lost", "trained_twice", "in_flight"):
        if totals[fate]:
            found.append(f"ledger: {totals[fate]} {fate}")
    if ledger["steps"] != steps:
        found.append(f"ledger: {ledger['steps']} steps, the experiment {steps}")
    if ledger["trained_groups"] != ledger["steps"] * batch_size:
        found.append(f"ledger: {ledger['trained_groups']} groups in {ledger['steps']} steps of {batch_size}")  # fmt: skip
    if totals["trained"] != ledger["trained_groups"]:
        found.append(f"ledger: {totals['trained']} prompts trained, {ledger['trained_groups']} groups")  # fmt: skip
    return found


async def _settled_ledger(experiment_id: str, nats_url: str):
    """The ledger once nothing is in flight (or after SETTLE_S, as it then is)."""
    from asyncrl.ledger import fetch_report

    deadline = time.monotonic() + SETTLE_S
    while True:
        report = await fetch_report(experiment_id, nats_url)
        if report.totals["in_flight"] == 0 or time.monotonic() > deadline:
            return report
        await asyncio.sleep(0.5)


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None
