"""Chat-formatted number questions for SmolLM2-135M-Instruct.

    python -m examples.smollm2.data --out var/smollm2                      # arithmetic
    python -m examples.smollm2.data --task larger --out var/smollm2-larger --n-eval 200

Writes <out>/train.jsonl and <out>/eval.jsonl (keys prompt, answer; disjoint). Tasks:
`arith`, "What is a + b?" / "What is a * b?" (two digits; the model is near 0 on it);
`larger`, "Which number is larger, a or b? Answer with the number only." (two different
two-digit numbers; the learning run's task, see docs/smollm2.md). The experiments set
`rollout.workflow.chat_template: true`, so the rollout service renders each question as a user
turn with the model's chat template and samples the assistant turn; the reward is
`numeric_match` (experiment.yaml: the last number in the answer; learn.yaml: the first).
Deterministic under --seed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def questions(n: int, rng: random.Random) -> list[tuple[str, int]]:
    out = []
    for _ in range(n):
        if rng.random() < 0.5:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            out.append((f"What is {a} + {b}?", a + b))
        else:
            a, b = rng.randint(2, 9), rng.randint(11, 29)
            out.append((f"What is {a} * {b}?", a * b))
    return out


def larger(n: int, rng: random.Random) -> list[tuple[str, int]]:
    out = []
    for _ in range(n):
        a, b = rng.sample(range(10, 100), 2)
        out.append((f"Which number is larger, {a} or {b}? Answer with the number only.", max(a, b)))
    return out


TASKS = {"arith": questions, "larger": larger}


def build(out: Path, n_train: int, n_eval: int, seed: int, task: str = "arith") -> None:
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    for q, a in TASKS[task](4 * (n_train + n_eval), rng):
        if q in seen:
            continue
        seen.add(q)
        rows.append({"prompt": q, "answer": str(a)})
        if len(rows) == n_train + n_eval:
            break
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("eval", rows[:n_eval]), ("train", rows[n_eval:])):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    print(f"wrote {n_train} train and {n_eval} eval questions to {out}/")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("var/smollm2"))
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-eval", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=sorted(TASKS), default="arith")
    a = p.parse_args()
    build(a.out, a.n_train, a.n_eval, a.seed, a.task)


if __name__ == "__main__":
    main()
