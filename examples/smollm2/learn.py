"""The SmolLM2 learning run against its control: figures, a table and a plot.

    python -m examples.smollm2.learn --learn ID --control ID --out var/smollm2-learn

`make smollm2-learn` runs `examples/smollm2/learn.yaml` twice through all four services (as
written, then with trainer.lr=1e-12, the control) and then this. It reads both experiments from
the scheduler (their step history and evals) and writes <out>/result.json and
<out>/learn.png: greedy eval accuracy on the 200 held-out prompts against version for both
runs, the training reward, and the rollout/trainer logprob mismatch.

`compare` is pure arithmetic over the two protos; `result.json` says whether the run met the
bar of issue 21 (gain >= 0.15 within 30 minutes, and the control's gain below it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from asyncrl.client import AsyncrlClient, default_address, read_groups
from asyncrl.machine import machine_line
from asyncrl.report import as_experiment, sorted_evals, summarize, token_versions, wall_seconds
from asyncrl.v1 import scheduler_pb2

GAIN = 0.15  # the bar: greedy accuracy up by at least this much ...
WALL_S = 30 * 60  # ... within this much experiment wall time


def run_figures(experiment: scheduler_pb2.Experiment | dict) -> dict:
    """One run: its summary (first and last eval, wall time), the gain between them, and the
    mismatch between the rollout's logprobs and the trainer's recomputation at the same
    version (token-weighted mean of the per-step means, max of the maxima)."""
    exp = as_experiment(experiment)
    figures = summarize(exp, round(wall_seconds(exp), 1))
    first, last = figures["initial_eval_accuracy"], figures["final_eval_accuracy"]
    tokens = sum(h.logprob_diff_tokens for h in exp.history)
    figures.update(
        evals=[
            (e.version, round(e.accuracy, 4), e.n_prompts, token_versions(e))
            for e in sorted_evals(exp)
        ],
        gain=last - first if len(exp.progress.evals) > 1 else None,
        mismatch_mean=(
            sum(h.logprob_diff_mean * h.logprob_diff_tokens for h in exp.history) / tokens
            if tokens
            else None
        ),
        mismatch_max=max((h.logprob_diff_max for h in exp.history), default=None),
        mismatch_tokens=tokens,
    )
    return figures


def compare(
    learn: scheduler_pb2.Experiment | dict, control: scheduler_pb2.Experiment | dict
) -> dict:
    """Both runs' figures and the verdict: the run gains >= GAIN within WALL_S, the control
    does not."""
    a, b = run_figures(learn), run_figures(control)
    learned = a["gain"] is not None and a["gain"] >= GAIN and a["wall_seconds"] <= WALL_S
    control_flat = b["gain"] is not None and b["gain"] < GAIN
    return {
        "learn": a,
        "control": b,
        "bar": {"gain": GAIN, "wall_seconds": WALL_S},
        "met": learned and control_flat,
        "machine": machine_line(),
    }


def plot(learn, control, out: str | Path) -> Path:
    """Eval accuracy (top), training reward (middle), logprob mismatch (bottom), by version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        3, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [2, 1, 1]}
    )
    for exp, label, colour in (
        (as_experiment(learn), "lr 1e-5", "C0"),
        (as_experiment(control), "control, lr 1e-12", "C1"),
    ):
        wall = wall_seconds(exp) / 60
        evals = sorted_evals(exp)
        history = sorted(exp.history, key=lambda h: h.version)
        axes[0].plot(
            [e.version for e in evals],
            [e.accuracy for e in evals],
            marker="o",
            color=colour,
            label=f"{label} ({wall:.1f} min)",
        )
        axes[1].plot(
            [h.version for h in history],
            [h.reward_mean for h in history],
            marker=".",
            color=colour,
            label=label,
        )
        measured = [h for h in history if h.logprob_diff_tokens > 0]  # tokens at its version
        axes[2].plot(
            [h.version for h in measured],
            [h.logprob_diff_max for h in measured],
            "^",
            color=colour,
            label=f"{label}, max |Δ|",
        )
        axes[2].plot(
            [h.version for h in measured],
            [h.logprob_diff_mean for h in measured],
            "o",
            color=colour,
            label=f"{label}, mean |Δ|",
        )
    axes[0].set_ylabel("greedy eval accuracy\n(200 held-out prompts)")
    axes[0].set_title("SmolLM2-135M-Instruct, 'which number is larger', CPU, η = 1")
    axes[1].set_ylabel("train reward mean")
    axes[2].set_ylabel("rollout vs trainer\nlogprob |Δ|, same version")
    axes[2].set_xlabel("version (optimizer step)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


async def _fetch(address: str, ids: list[str]) -> list[scheduler_pb2.Experiment]:
    async with AsyncrlClient(address) as client:
        return [await client.get(i, with_history=True) for i in ids]


async def final_answers(exp: scheduler_pb2.Experiment, k: int = 12) -> list[dict]:
    """The first `k` greedy eval answers at the run's last version, decoded: what the reward
    scored, for a reader to judge (a policy can learn to please a rule without answering)."""
    from transformers import AutoTokenizer

    spec = json.loads(exp.spec_json)
    tok = AutoTokenizer.from_pretrained(spec["model"]["path"])
    last = exp.progress.version
    out = []
    async for g in read_groups(exp.id, include_eval=True):
        if g.eval and g.start_version == last:
            s = g.samples[0]
            out.append(
                {
                    "answer": g.answer,
                    "reward": s.reward,
                    "completion": tok.decode(s.output_ids, skip_special_tokens=True),
                }
            )
            if len(out) == k:
                break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--learn", required=True, help="the learning run's experiment id")
    p.add_argument("--control", required=True, help="the control run's experiment id")
    p.add_argument("--out", type=Path, default=Path("var/smollm2-learn"))
    p.add_argument("--scheduler", default=None, help="HOST:PORT (default ASYNCRL_SCHEDULER)")
    a = p.parse_args()
    learn, control = asyncio.run(_fetch(a.scheduler or default_address(), [a.learn, a.control]))
    result = compare(learn, control)
    result["learn"]["final_answers"] = asyncio.run(final_answers(learn))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(learn, control, a.out / "learn.png")
    for name in ("learn", "control"):
        r = result[name]
        print(
            f"{name:8s} {r['experiment_id']}: accuracy {r['initial_eval_accuracy']} -> "
            f"{r['final_eval_accuracy']} in {r['wall_seconds']} s, {r['steps']} steps; "
            f"mismatch mean {r['mismatch_mean']} max {r['mismatch_max']}"
        )
    for answer in result["learn"]["final_answers"]:
        print(
            f"  answer {answer['answer']:>4s}  reward {answer['reward']}  {answer['completion']!r}"
        )
    print(
        f"bar (gain >= {GAIN} within {WALL_S} s, control below): "
        f"{'met' if result['met'] else 'NOT met'}; wrote {a.out}/result.json, learn.png"
    )


if __name__ == "__main__":
    main()
